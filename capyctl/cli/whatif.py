"""``capyctl simulate``: replay a trace against a scenario (docs/what-if.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from capyctl.errors import UserError

_PICTURES = (".png", ".svg")


def _scenario(source: str | None) -> tuple[dict[str, Any], str]:
    from capyctl.whatif import scenario

    if source is None or source == "current":
        return scenario.current(), "current"
    return scenario.load_file(source), Path(source).stem


def simulate(args: argparse.Namespace) -> int:
    from capyctl.whatif import report, scenario
    from capyctl.whatif.engine import replay
    from capyctl.whatif.trace import read_trace

    if args.timeline and not args.timeline.lower().endswith(_PICTURES):
        raise UserError(f"--timeline {args.timeline}: the file must end in .png or .svg")
    requests = read_trace(args.trace)
    data, name = _scenario(args.scenario)
    changes = []
    if args.hosts:
        data = scenario.with_hosts(data, args.hosts)
        changes.append(f"hosts {args.hosts}")
    if args.set:
        data = scenario.apply_sets(data, args.set)
        changes.extend(args.set)
    if changes:
        name = f"{name} with {', '.join(changes)}"
    mine = scenario.build(data, name, warm=args.warm)
    theirs = None
    if args.compare:
        other, other_name = _scenario(args.compare)
        theirs = scenario.build(other, other_name, warm=args.warm)
    if args.save_scenario:
        scenario.save(data, args.save_scenario)
    outcome = replay(mine, requests)
    result = report.summary(outcome)
    compared = report.summary(replay(theirs, requests)) if theirs is not None else None
    if args.timeline:
        report.timeline(outcome, args.timeline)
    if args.json:
        print(json.dumps(result if compared is None else {"scenario": result, "compare": compared},
                         indent=2))  # fmt: skip
    else:
        print(report.text(result, compared))
    return 0
