"""``capyctl start host``: the host agent of a GPU machine. It needs no database, no Django
and none of the server's packages: the slim install (``capyctl-host``) runs it."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from capyctl.cli.listening import check_port_free, parse_listen, warn_if_open
from capyctl.errors import UserError


def start_host(args: argparse.Namespace) -> int:
    """The host agent. Needs no database (nor Django's settings): it answers the server
    over mutual TLS."""
    from capyctl.conf import ConfigError, env_float
    from hostagent.agent import AgentError, AgentFiles, join, serve
    from hostagent.runtime import DEFAULT_RELEASE_SECONDS

    data_dir = Path(getattr(args, "data_dir", None) or os.environ.get("CAPYCTL_DATA_DIR")
                    or Path.cwd() / ".capyctl-host")  # fmt: skip
    files = AgentFiles(data_dir)
    warn_if_open(data_dir)
    try:
        release = env_float("CAPYCTL_PARK_CONFIRM_SECONDS", DEFAULT_RELEASE_SECONDS, minimum=0.1)
        host, port = parse_listen(args.listen)
        if args.join:
            if files.joined():
                raise AgentError(
                    f"{data_dir} already holds the enrolment of host {files.host_name()}: "
                    "start without --join, or use another --data-dir"
                )
            name = join(args.join, files)
            print(f"joined as host {name}; certificate in {files.cert}", flush=True)
        check_port_free(host, port)
        serve(files, host, port, release_timeout=release)
    except (AgentError, UserError, ConfigError) as exc:
        print(f"capyctl: error: {exc}", file=sys.stderr)
        return 2
    return 0
