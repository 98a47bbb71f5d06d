"""A replay's answer: per model and overall, side by side for two scenarios, as text or
JSON; and a timeline picture of each GPU pool."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from capyctl.whatif.outcome import Hold, Outcome, Served, Switch

SWITCH_KINDS = ("start", "wake ram", "wake deep", "park ram", "park deep", "stop")


def _percentile(values: list[float], share: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def _figures(requests: list[Served], switches: list[Switch], holds: list[Hold]) -> dict[str, Any]:
    served = [r for r in requests if r.status == 200]
    refused = Counter(r.code or str(r.status) for r in requests if r.status != 200)
    kinds = Counter(s.label for s in switches)
    waits = [r.waited for r in served]
    return {
        "requests": len(requests),
        "served": len(served),
        "refused": dict(sorted(refused.items())),
        "wait_p50_seconds": round(_percentile(waits, 0.5), 3),
        "wait_p99_seconds": round(_percentile(waits, 0.99), 3),
        "switches": {kind: kinds.get(kind, 0) for kind in SWITCH_KINDS},
        "gpu_seconds_held": round(sum(h.end - h.begin for h in holds), 1),
    }


def _idle_gpu_seconds(outcome: Outcome) -> float:
    """Pool-seconds in which no model held the pool (its GPU idle) over the replay."""
    spans: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for hold in outcome.holds:
        spans.setdefault((hold.host, hold.pool), []).append((hold.begin, hold.end))
    idle = 0.0
    for key in outcome.pools:
        covered, reach = 0.0, 0.0
        for began, end in sorted(spans.get(key, [])):
            begin = max(began, reach)
            if end > begin:
                covered += end - begin
                reach = end
        idle += max(outcome.duration - covered, 0.0)
    return idle


def summary(outcome: Outcome) -> dict[str, Any]:
    """Everything ``capyctl simulate --json`` prints for one scenario."""
    requests: dict[str, list[Served]] = defaultdict(list)
    switches: dict[str, list[Switch]] = defaultdict(list)
    holds: dict[str, list[Hold]] = defaultdict(list)
    for request in outcome.requests:
        requests[request.model].append(request)
    for switch in outcome.switches:
        switches[switch.model].append(switch)
    for hold in outcome.holds:
        holds[hold.model].append(hold)
    names = sorted(set(requests) | set(switches))
    overall = _figures(outcome.requests, outcome.switches, outcome.holds)
    overall["idle_gpu_seconds"] = round(_idle_gpu_seconds(outcome), 1)
    overall["replayed_seconds"] = round(outcome.duration, 1)
    return {
        "scenario": outcome.scenario,
        "overall": overall,
        "models": {name: _figures(requests[name], switches[name], holds[name]) for name in names},
        "simulator": {
            "events": outcome.events,
            "wall_seconds": round(outcome.wall_seconds, 3),
            "events_per_second": round(outcome.events / outcome.wall_seconds)
            if outcome.wall_seconds
            else None,
            "plans": outcome.plans,
            "plan_ms_mean": round(1000 * outcome.plan_seconds / outcome.plans, 3)
            if outcome.plans
            else 0.0,
        },
    }


def _cells(figures: dict[str, Any]) -> list[tuple[str, str]]:
    switches = figures["switches"]
    refused = figures["refused"]
    cells = [
        ("requests", str(figures["requests"])),
        ("served", str(figures["served"])),
        ("refused", ", ".join(f"{code} {n}" for code, n in refused.items()) or "0"),
        ("wait p50", f"{figures['wait_p50_seconds']:.2f} s"),
        ("wait p99", f"{figures['wait_p99_seconds']:.2f} s"),
    ]
    cells += [(kind, str(switches[kind])) for kind in SWITCH_KINDS]
    cells.append(("GPU-s held", f"{figures['gpu_seconds_held']:.0f}"))
    if "idle_gpu_seconds" in figures:
        cells.append(("GPU-s idle", f"{figures['idle_gpu_seconds']:.0f}"))
    return cells


def _cell(figures: dict[str, Any] | None, at: int) -> str:
    cells = _cells(figures) if figures is not None else []
    return cells[at][1] if at < len(cells) else ""


def text(result: dict[str, Any], other: dict[str, Any] | None = None) -> str:
    """The answer as a table: rows of figures, a column per model (and overall); with
    ``other``, each cell shows both scenarios and the change."""
    columns = ["overall", *result["models"]]
    if other is not None:
        columns += [m for m in other["models"] if m not in columns]

    def figures(data: dict[str, Any], column: str) -> dict[str, Any] | None:
        found: dict[str, Any] | None = (
            data["overall"] if column == "overall" else data["models"].get(column)
        )
        return found

    rows: list[list[str]] = []
    labels = [label for label, _ in _cells(result["overall"])]
    for at, label in enumerate(labels):
        row = [label]
        for column in columns:
            mine = figures(result, column)
            cell = _cells(mine)[at][1] if mine is not None and at < len(_cells(mine)) else ""
            if other is not None:
                theirs = figures(other, column)
                then = (
                    _cells(theirs)[at][1] if theirs is not None and at < len(_cells(theirs)) else ""
                )
                cell = cell if cell == then else f"{then} -> {cell}"
            row.append(cell)
        rows.append(row)
    head = ["", *columns]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = []
    title = result["scenario"] if other is None else f"{other['scenario']} -> {result['scenario']}"
    lines.append(f"scenario: {title} ({result['overall']['replayed_seconds']:.0f} s replayed)")
    for row in [head, *rows]:
        lines.append("  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
                               for i, cell in enumerate(row)).rstrip())  # fmt: skip
    sim = result["simulator"]
    lines.append(
        f"simulated {sim['events']} events in {sim['wall_seconds']:.2f} s; "
        f"{sim['plans']} placement decisions, {sim['plan_ms_mean']:.2f} ms each"
    )
    return "\n".join(lines)


# -- the timeline ---------------------------------------------------------------------------

MAX_TIMELINE_POOLS = 64


def timeline(outcome: Outcome, path: str) -> None:
    """Each pool's occupancy over time by model (loading lighter), a red mark at each park
    or stop, and the requests waiting beneath; ``path`` ends in ``.png`` or ``.svg``."""
    import matplotlib  # noqa: PLC0415 - only for a picture

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    pools = sorted(outcome.pools)[:MAX_TIMELINE_POOLS]
    models = sorted({h.model for h in outcome.holds})
    colours = plt.get_cmap("tab10")
    colour = {m: colours(i % 10) for i, m in enumerate(models)}
    height = 0.6 * len(pools) + 1.6
    figure, (lanes, queue) = plt.subplots(
        2, 1, sharex=True, figsize=(11, height), height_ratios=[max(len(pools), 1), 1.2]
    )
    row = {pool: at for at, pool in enumerate(pools)}
    for hold in outcome.holds:
        at = row.get((hold.host, hold.pool))
        if at is None:
            continue
        alpha = {"serve": 0.95, "load": 0.45, "park": 0.3}[hold.phase]
        lanes.broken_barh([(hold.begin, hold.end - hold.begin)], (at - 0.38, 0.76),
                          facecolors=colour[hold.model], alpha=alpha, linewidth=0)  # fmt: skip
    for switch in outcome.switches:
        if switch.kind not in ("park", "stop"):
            continue
        for pool in switch.pools:
            at = row.get((switch.host, pool))
            if at is not None:
                lanes.plot([switch.at], [at + 0.45], marker="v", color="red", markersize=5)
    lanes.set_yticks(range(len(pools)), [f"{h} {p}" for h, p in pools])
    lanes.set_ylim(-0.6, len(pools) - 0.4)
    lanes.invert_yaxis()
    lanes.set_title(f"{outcome.scenario}: who held each GPU (lighter: loading or parking; "
                    "red: a park or stop)", fontsize=9)  # fmt: skip
    handles = [Patch(color=colour[m], label=m) for m in models[:20]]
    if handles:
        lanes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7,
                     frameon=False)  # fmt: skip
    times = [t for t, _ in outcome.waiting]
    counts = [n for _, n in outcome.waiting]
    if times:
        queue.step([0.0, *times, outcome.duration], [0, *counts, counts[-1]], where="post",
                   color="grey")  # fmt: skip
    queue.set_ylabel("waiting", fontsize=8)
    queue.set_xlabel("seconds")
    queue.set_xlim(0, max(outcome.duration, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


__all__ = ["Hold", "summary", "text", "timeline"]
