"""A replay's answer: per model and overall, side by side for two scenarios, as text or
JSON; and a timeline picture of each GPU pool. A model of several replicas is one model
here, its replicas counted together, with its scaling steps and the most replicas it had
up at once. Where the scenario has adapters, each adapter's loads (and the adapters
unloaded to make room) are counted in its column and in its base's."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from capyctl.whatif.model import DEFAULT_ADAPTER_LOAD_SECONDS
from capyctl.whatif.outcome import AdapterLoad, Hold, Outcome, ReplicaSet, Scaled, Served, Switch

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


def _scaling(steps: list[Scaled], replica_set: ReplicaSet | None = None) -> dict[str, Any]:
    """A model's scaling steps (every model's, for ``replica_set`` None): replicas brought
    up, by how (woken or started), and parked; and the steps that brought none up."""
    actions = Counter(step.action for step in steps if step.done)
    figures: dict[str, Any] = {}
    if replica_set is not None:
        figures = {"minimum": replica_set.minimum, "maximum": replica_set.maximum,
                   "peak_up": replica_set.peak_up}  # fmt: skip
    figures["scaled_up"] = {"wake": actions.get("wake", 0), "start": actions.get("start", 0)}
    figures["scaled_down"] = actions.get("park", 0)
    # steps that brought no replica up: no room for one, or none in max_queue_seconds
    figures["scale_ups_not_done"] = sum(1 for step in steps if not step.done)
    return figures


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
    scaled: dict[str, list[Scaled]] = defaultdict(list)
    for step in outcome.scaled:
        scaled[step.model].append(step)
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
    models = {name: _figures(requests[name], switches[name], holds[name]) for name in names}
    if outcome.adapters:
        _adapter_figures(outcome, overall, models)
    if outcome.replica_sets:
        overall["replicas"] = _scaling(outcome.scaled)
        for name, replica_set in outcome.replica_sets.items():
            if name in models:
                models[name]["replicas"] = _scaling(scaled[name], replica_set)
    return {
        "scenario": outcome.scenario,
        "overall": overall,
        "models": models,
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


def _adapter_figures(outcome: Outcome, overall: dict[str, Any], models: dict[str, Any]) -> None:
    """Adapter loads, their seconds and the unloads that made room: overall, per adapter,
    and per base (those into its engines); and the adapters whose loads took the default
    time, never measured."""
    mine: dict[str, list[AdapterLoad]] = defaultdict(list)
    unloaded: Counter[str] = Counter()
    for load in outcome.adapter_loads:
        base = load.engine.partition("~")[0]
        mine[load.adapter].append(load)
        mine[base].append(load)
        unloaded.update(load.unloaded)
    overall["adapter_loads"] = _loads(outcome.adapter_loads)
    for name, figures in models.items():
        figures["adapter_loads"] = _loads(mine.get(name, []))
        if name in outcome.adapters:  # an adapter's: the times it was unloaded
            figures["adapter_loads"]["unloads"] = unloaded.get(name, 0)
    overall["adapters_unmeasured"] = list(outcome.adapters_unmeasured)


def _loads(loads: list[AdapterLoad]) -> dict[str, Any]:
    return {
        "count": len(loads),
        "seconds": round(sum(load.seconds for load in loads), 3),
        "unloads": sum(len(load.unloaded) for load in loads),
    }


def _cells(
    figures: dict[str, Any], replicas: bool = False, adapters: bool = False
) -> list[tuple[str, str]]:
    """The rows of one column; ``replicas``: with the rows of models of several replicas
    (a model of one replica shows 1 replica, and no steps)."""
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
    if adapters:
        loads = figures.get("adapter_loads") or _loads([])
        cells += [("adapter load", str(loads["count"])),
                  ("adapter load time", f"{loads['seconds']:.1f} s"),
                  ("adapter unload", str(loads["unloads"]))]  # fmt: skip
    if replicas:
        cells += _replica_cells(figures)
    cells.append(("GPU-s held", f"{figures['gpu_seconds_held']:.0f}"))
    if "idle_gpu_seconds" in figures:
        cells.append(("GPU-s idle", f"{figures['idle_gpu_seconds']:.0f}"))
    return cells


def _replica_cells(figures: dict[str, Any]) -> list[tuple[str, str]]:
    """A column's rows of replicas: a model's bounds (``MIN:MAX``, or ``N`` where all are
    kept up), the most up at once and its scaling steps; overall, every model's steps."""
    found = figures.get("replicas")
    if found is None and "idle_gpu_seconds" not in figures:  # a model of one replica
        return [("replicas", "1"), ("replicas peak", "-"), ("scale-up wake", "-"),
                ("scale-up start", "-"), ("scale-down", "-")]  # fmt: skip
    found = found or _scaling([])
    bounds = peak = ""
    if "maximum" in found:
        low, high = found["minimum"], found["maximum"]
        bounds, peak = (str(high) if low == high else f"{low}:{high}"), str(found["peak_up"])
    return [
        ("replicas", bounds),
        ("replicas peak", peak),
        ("scale-up wake", str(found["scaled_up"]["wake"])),
        ("scale-up start", str(found["scaled_up"]["start"])),
        ("scale-down", str(found["scaled_down"])),
    ]


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

    replicas = any(
        "replicas" in found for data in (result, other) if data for found in data["models"].values()
    )

    adapters = any("adapter_loads" in data["overall"] for data in (result, other) if data)

    def cells(data: dict[str, Any], column: str) -> list[tuple[str, str]]:
        found = figures(data, column)
        return _cells(found, replicas, adapters) if found is not None else []

    rows: list[list[str]] = []
    labels = [label for label, _ in _cells(result["overall"], replicas, adapters)]
    for at, label in enumerate(labels):
        row = [label]
        for column in columns:
            mine = cells(result, column)
            cell = mine[at][1] if at < len(mine) else ""
            if other is not None:
                theirs = cells(other, column)
                then = theirs[at][1] if at < len(theirs) else ""
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
    unmeasured = result["overall"].get("adapters_unmeasured") or []
    if unmeasured:
        named = ", ".join(unmeasured[:3]) + (f" and {len(unmeasured) - 3} more"
                                             if len(unmeasured) > 3 else "")  # fmt: skip
        lines.append(
            f"adapter loads never measured take {DEFAULT_ADAPTER_LOAD_SECONDS:g} s "
            f"(ServerlessLLM's measured 83.5 ms, rounded): {named}"
        )
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
