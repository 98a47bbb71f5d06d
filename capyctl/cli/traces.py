"""Handler of ``capyctl trace``: the requests the gateway recorded, as JSON Lines."""

from __future__ import annotations

import argparse
import sys

from capyctl.cli.commands import prepare
from capyctl.errors import UserError


def trace_export(args: argparse.Namespace) -> int:
    """Print the traces from ``--since`` to ``--until``, oldest first, a line each as they
    are read (the table is never held in memory)."""
    from django.utils import timezone

    from capyctl.traces.export import trace_lines
    from capyctl.validation import parse_moment

    now = timezone.now()
    since = parse_moment(args.since, field="--since", now=now) if args.since else None
    until = parse_moment(args.until, field="--until", now=now) if args.until else None
    if since is not None and until is not None and until <= since:
        raise UserError(f"--until {args.until!r} is not after --since {args.since!r}")
    prepare()
    write = sys.stdout.write
    for line in trace_lines(since=since, until=until, model=args.model):
        write(line + "\n")
    return 0
