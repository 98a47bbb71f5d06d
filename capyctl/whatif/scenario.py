"""Scenarios: what a replay runs against, and the changes people try.

A scenario file has the shape of ``capyctl status --json`` (its ``hosts``, ``engines``,
``deployments`` and ``ledger``; the rest is ignored); each deployment may also carry
``timings`` (seconds: ``start``, ``park_ram``, ``park_deep``, ``wake_ram``, ``wake_deep``,
``stop``, ``service``) and ``can_park_ram``/``can_park_deep``, and the file an
``adapters`` list (:mod:`capyctl.whatif.scenario_adapters`). :func:`current` makes one
from the live configuration, with each model's timings as CapyCTL measured them (the
median of its recorded starts, parks, wakes and stops). Memory claims follow DESIGN §6
through :mod:`capyctl.scheduler.estimates`, as a start would.

Changes: ``--set NAME.FIELD=VALUE`` (NAME a name or a shell pattern: ``*`` every model,
``ft-*``) for the fields in :data:`SETTABLE` (``replicas``: ``N`` or ``MIN:MAX``, as
``capyctl deployment scale`` takes them; ``adapter_of``: models made adapters of a base,
and back; ``key.ID.class``: ``batch`` or ``interactive``, the class of that key's
requests in the trace), and ``--hosts 2x80GiB,1x24GiB`` (hosts of N GPUs of a size each, host RAM
after a colon: ``2x80GiB:512GiB``), which replaces the hosts: models then go where they
fit.
"""

from __future__ import annotations

import copy
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from capyctl.access.classes import BATCH, CLASSES
from capyctl.deployments.settings_spec import MAX_REPLICAS, SPREAD_CHOICES, builtin_default
from capyctl.errors import UserError
from capyctl.whatif import scenario_adapters
from capyctl.whatif.model import TIMING_NAMES, Scenario, SimHost, SimModel, SimReplica, Timings

GIB = 1024**3
DEFAULT_HOST_RAM = 64 * GIB  # host RAM of a host given by --hosts without one
MAX_HOSTS = 10_000
MAX_GPUS_PER_HOST = 64

# --set fields: name -> (kind of value, what SimModel field it sets)
SETTABLE: dict[str, str] = {
    "min_ready_seconds": "seconds",
    "max_turn_seconds": "seconds",
    "max_queue_seconds": "seconds",
    "idle_park_seconds": "seconds",
    "max_waiting": "count",
    "priority": "integer",
    "pinned": "bool",
    "park": "park",
    "gpus": "count",
    "gpu_memory": "size",
    "weights": "size",
    "host": "host",
    "replicas": "replicas",
    "target_concurrency": "positive",
    "scale_up_wait_seconds": "positive",
    "spread": "spread",
    "max_concurrency": "count",
    **{f"{name}_seconds": "timing" for name in TIMING_NAMES},
    # a base's slots; models made adapters and back (capyctl.whatif.scenario_adapters)
    "adapter_slots": "count",
    "adapter_of": "base",
    "adapter_load_seconds": "timing",
}
_ADAPTER_FIELDS = ("adapter_of", "adapter_load_seconds")
_PARK_POLICIES = ("auto", "ram", "deep", "stop", "never")
_KEY_RE = re.compile(r"^key\.(\d{1,18})$")
_REPLICAS_RE = re.compile(r"^(?:(\d{1,6}):)?(\d{1,6})$")
_HOSTS_RE = re.compile(r"^(\d{1,3})x([0-9.]+[A-Za-z]*)(?::([0-9.]+[A-Za-z]*))?$")


def load_file(path: str) -> dict[str, Any]:
    """A scenario file's JSON (``capyctl status --json`` or ``capyctl simulate
    --save-scenario``)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"scenario {path}: no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise UserError(f"scenario {path}: cannot be read ({type(exc).__name__})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"scenario {path}: not JSON (line {exc.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("deployments"), list):
        raise UserError(
            f"scenario {path}: not a scenario (want the shape of `capyctl status --json`)"
        )
    return data


def current() -> dict[str, Any]:
    """The live configuration as a scenario: ``capyctl status --json``'s data, each
    deployment with what its engine can park and the timings CapyCTL measured."""
    from capyctl.deployments.models import Deployment  # noqa: PLC0415 - Django only here
    from capyctl.reports import status_data  # noqa: PLC0415
    from hostagent.kinds import KindError, get_kind  # noqa: PLC0415

    data = status_data()
    measured = measured_timings()
    engines = {d.name: d.engine for d in Deployment.objects.select_related("engine")}
    for row in data["deployments"]:
        engine = engines.get(row["name"])
        if engine is not None:
            try:
                can = get_kind(engine.kind).capabilities(engine.options, engine.features())
                row["can_park_ram"], row["can_park_deep"] = can.ram, can.deep
            except KindError:
                row["can_park_ram"] = row["can_park_deep"] = False
        if row["name"] in measured:
            row["timings"] = measured[row["name"]]
    found = {key: data[key] for key in ("mode", "hosts", "engines", "deployments", "ledger")}
    found["adapters"] = scenario_adapters.current(data["adapters"])
    found["batch_keys"] = batch_keys()
    return found


def batch_keys() -> list[int]:
    """The ids of the keys whose requests are batch (their own class, or their team's)."""
    from capyctl.access.models import ApiKey  # noqa: PLC0415 - Django only here

    own = ApiKey.objects.filter(priority_class=BATCH)
    by_team = ApiKey.objects.filter(priority_class="", team__priority_class=BATCH)
    return sorted({*own.values_list("pk", flat=True), *by_team.values_list("pk", flat=True)})


def measured_timings() -> dict[str, dict[str, float]]:
    """Per deployment, the median seconds of its recorded starts, parks and wakes (by
    mode) and stops, its replicas' with its own: what its events say they took. A start's
    or a wake's event counts from when it was asked, so it holds the parks and stops that
    made room for it on its host meanwhile: those are taken out."""
    from capyctl.events.models import Event  # noqa: PLC0415

    rows = Event.objects.filter(
        kind__in=("deployment.ready", "deployment.parked", "deployment.woke",
                  "deployment.stopped"),
        duration_ms__isnull=False,
        deployment__isnull=False,
    ).order_by("created_at", "id").values_list(
        "deployment__name", "deployment__host_id", "kind", "data", "duration_ms", "created_at"
    )  # fmt: skip
    found: dict[str, dict[str, list[float]]] = {}
    making_room: dict[object, list[tuple[float, float]]] = {}  # host -> (end, seconds)
    for name, host, kind, data, duration, created in rows.iterator():
        seconds = (duration or 0) / 1000
        end = created.timestamp()
        mode = data.get("mode") if isinstance(data, dict) else None
        if kind in ("deployment.parked", "deployment.stopped"):
            making_room.setdefault(host, []).append((end, seconds))
        if kind in ("deployment.ready", "deployment.woke"):
            seconds -= sum(took for at, took in making_room.get(host, [])
                           if end - (duration or 0) / 1000 <= at - took and at <= end)  # fmt: skip
        step = {
            "deployment.ready": "start",
            "deployment.stopped": "stop",
            "deployment.parked": f"park_{mode}" if mode in ("ram", "deep") else None,
            "deployment.woke": f"wake_{mode}" if mode in ("ram", "deep") else None,
        }[kind]
        if step is not None:  # a replica's (NAME~N) count as its deployment's
            served = name.partition("~")[0]
            found.setdefault(served, {}).setdefault(step, []).append(max(seconds, 0.0))
    return {
        name: {step: round(statistics.median(values), 3) for step, values in steps.items()}
        for name, steps in found.items()
    }


# -- changes ---------------------------------------------------------------------------------


def apply_sets(data: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """``NAME.FIELD=VALUE`` changes, checked, on a copy of the scenario's data. NAME is a
    model's (or an adapter's) name or a shell pattern (``*``, ``ft-*``); the changes that
    turn models into adapters and back come first, in their order, then the others."""
    data = copy.deepcopy(data)
    parsed = []
    for item in sets:
        target, sep, value = item.partition("=")
        name, dot, field = target.rpartition(".")
        if not sep or not dot or not name:
            raise UserError(f"--set {item!r}: use NAME.FIELD=VALUE, like chat.min_ready_seconds=30")
        if field == "class":
            _set_class(data, name, value, item)
            continue
        if field not in SETTABLE:
            raise UserError(
                f"--set {item!r}: no field {field!r}; one of {', '.join(sorted(SETTABLE))}"
            )
        parsed.append((item, name, field, value))
    for item, name, field, value in sorted(parsed, key=lambda p: p[2] != "adapter_of"):
        kind = SETTABLE[field]
        if field in _ADAPTER_FIELDS:
            if field == "adapter_of":
                scenario_adapters.turn(data, name, _value(kind, value, item), item)
            else:
                scenario_adapters.set_load(data, name, _value(kind, value, item), item)
            continue
        rows = [r for r in data["deployments"] if scenario_adapters.matches(name, r.get("name"))]
        if not rows:
            scenario_adapters.refuse_for_adapter(data, name, field, item)
            raise UserError(f"--set {item!r}: no model {name!r} in the scenario")
        parsed_value = _value(kind, value, item)
        for row in rows:
            _set(row, field, kind, parsed_value)
    return data


def _set_class(data: dict[str, Any], name: str, value: str, item: str) -> None:
    """``key.ID.class=batch|interactive``: the class of a key's requests in the replay."""
    match = _KEY_RE.match(name)
    if match is None:
        raise UserError(
            f"--set {item!r}: a class is a key's: key.ID.class=batch, like key.3.class=batch"
        )
    if value not in CLASSES:
        raise UserError(f"--set {item!r}: a class is interactive or batch")
    keys = set(_batch_keys(data))
    key = int(match.group(1))
    if value == BATCH:
        keys.add(key)
    else:
        keys.discard(key)
    data["batch_keys"] = sorted(keys)


# Each kind of number: its type, its bounds, and what a value of it is called.
_NUMBERS: dict[str, tuple[type[float] | type[int], float, float, str]] = {
    "seconds": (float, 0, 10**7, "a seconds value"),
    "timing": (float, 0, 10**7, "a timing value"),
    "count": (int, 0, 10**6, "a count value"),
    "integer": (int, -math.inf, math.inf, "an integer value"),
    "positive": (int, 1, 10**7, "a whole number of 1 or more"),
}
_CHOICES = {"park": _PARK_POLICIES, "spread": SPREAD_CHOICES}


def _value(kind: str, value: str, item: str) -> Any:
    from capyctl.validation import parse_size_value  # noqa: PLC0415

    text = value.strip()
    if kind in _NUMBERS:
        number_type, least, most, words = _NUMBERS[kind]
        try:
            number = number_type(text)
        except ValueError:
            number = None
        if number is None or not least <= number <= most:  # NaN too
            raise UserError(f"--set {item!r}: {value!r} is not {words}")
        return number
    if kind in _CHOICES:
        if text not in _CHOICES[kind]:
            raise UserError(f"--set {item!r}: {kind} is one of {', '.join(_CHOICES[kind])}")
        return text
    if kind == "replicas":
        return _replicas(text, item)
    if kind == "bool":
        if text.lower() not in ("true", "false", "yes", "no", "1", "0"):
            raise UserError(f"--set {item!r}: use true or false")
        return text.lower() in ("true", "yes", "1")
    if kind == "size":
        try:
            return parse_size_value(text, field="size")
        except UserError as exc:
            raise UserError(f"--set {item!r}: {exc}") from None
    return text or None  # a host's or a base's name; empty: none


def _replicas(text: str, item: str) -> tuple[int, int]:
    """``N`` (N kept up) or ``MIN:MAX``: (MIN, MAX), MIN 0 where only N is given."""
    match = _REPLICAS_RE.match(text)
    if match is None:
        raise UserError(f"--set {item!r}: replicas is N or MIN:MAX, like 2 or 1:3")
    low, high = int(match[1] or 0), int(match[2])
    for number in (low, high) if match[1] else (high,):
        if not 1 <= number <= MAX_REPLICAS:
            raise UserError(f"--set {item!r}: replicas are 1 to {MAX_REPLICAS}, not {number}")
    if low > high:
        raise UserError(f"--set {item!r}: {low} is more than {high}")
    return low, high


def _set(row: dict[str, Any], field: str, kind: str, value: Any) -> None:
    if kind == "replicas":
        row["min_replicas"], row["replicas"] = value
        return
    if kind == "timing":
        row.setdefault("timings", {})[field.removesuffix("_seconds")] = value
    elif field == "gpu_memory":
        row["gpu_memory_bytes"], row["gpu_memory_fraction"] = value, None
        row["measured_gpu_bytes"] = None
    elif field == "weights":
        row["weights_bytes"] = value
    else:
        row[field] = value
    if field in ("gpus", "host", "gpu_memory", "weights"):
        row["measured_residual_bytes"] = None  # as the server forgets it on such a change
    if field in ("gpus", "host", "gpu_memory"):
        row["observed_state"] = "stopped"  # placed afresh
        for replica in _replica_rows(row):
            replica["observed_state"] = "stopped"
            if field == "host":
                replica["host"] = value


def _replica_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The replicas past the first that a deployment's ``replica_set`` lists."""
    rows = row.get("replica_set")
    if not isinstance(rows, list):
        return []
    return [r for r in rows if isinstance(r, dict) and r.get("index") != 0]


def parse_hosts(spec: str) -> list[dict[str, Any]]:
    """``2x80GiB,1x24GiB:128GiB`` -> hosts as ``capyctl status --json`` shows them."""
    from django.conf import settings  # noqa: PLC0415

    from hostagent.units import SizeError, parse_size  # noqa: PLC0415

    gpu_reserve = int(settings.CAPYCTL["GPU_RESERVE_BYTES"])
    ram_reserve = int(settings.CAPYCTL["RAM_RESERVE_BYTES"])
    hosts = []
    parts = [p.strip() for p in spec.split(",")]
    if not spec.strip() or len(parts) > MAX_HOSTS:
        raise UserError(f"--hosts {spec!r}: use a list like 2x80GiB,1x24GiB")
    for number, part in enumerate(parts, 1):
        match = _HOSTS_RE.match(part)
        if match is None:
            raise UserError(f"--hosts {spec!r}: {part!r} is not NxSIZE (like 2x80GiB)")
        count = int(match[1])
        if not 1 <= count <= MAX_GPUS_PER_HOST:
            raise UserError(f"--hosts {spec!r}: {part!r}: 1 to {MAX_GPUS_PER_HOST} GPUs a host")
        try:
            size = parse_size(match[2], unit_required=True)
            ram = parse_size(match[3], unit_required=True) if match[3] else DEFAULT_HOST_RAM
        except SizeError as exc:
            raise UserError(f"--hosts {spec!r}: {exc}") from None
        pools = [{"pool": f"gpu{i}", "capacity_bytes": max(size - gpu_reserve, 0),
                  "total_bytes": size, "foreign_bytes": 0} for i in range(count)]  # fmt: skip
        pools.append({"pool": "ram", "capacity_bytes": max(ram - ram_reserve, 0),
                      "total_bytes": ram, "foreign_bytes": 0})  # fmt: skip
        hosts.append(
            {
                "name": f"sim{number}",
                "state": "online",
                "unified": False,
                "gpus": [{"index": i, "total_bytes": size} for i in range(count)],
                "ram_total_bytes": ram,
                "pools": pools,
            }
        )
    return hosts


def with_hosts(data: dict[str, Any], spec: str) -> dict[str, Any]:
    """The scenario on other hosts: models go where they fit, each starting stopped."""
    data = copy.deepcopy(data)
    data["hosts"] = parse_hosts(spec)
    data["ledger"] = []
    for row in data["deployments"]:
        row["host"], row["observed_state"] = None, "stopped"
        for replica in _replica_rows(row):
            replica["host"], replica["observed_state"] = None, "stopped"
    return data


# -- building ---------------------------------------------------------------------------------


def build(data: dict[str, Any], name: str = "current", *, warm: bool = False) -> Scenario:
    """The scenario a replay runs on. ``warm``: models hold what the ledger says they
    hold (ready or parked) when the replay begins; else every model starts stopped."""
    try:
        hosts = [_host(row) for row in data.get("hosts") or []]
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise UserError(f"the scenario has a host it cannot read ({type(exc).__name__})") from None
    if not hosts:
        raise UserError("the scenario has no hosts (add one, or give --hosts 1x24GiB)")
    engines = {e.get("name"): e for e in data.get("engines") or [] if isinstance(e, dict)}
    held: dict[str, list[str]] = {}
    for entry in data.get("ledger") or []:
        pool = str(entry.get("pool", ""))
        if entry.get("deployment") and pool != "ram":
            held.setdefault(str(entry["deployment"]), []).append(pool)
    models = []
    sizes = {h.name: min(h.gpus, default=0) for h in hosts}
    for row in data["deployments"]:
        if not isinstance(row, dict) or not isinstance(row.get("name"), str):
            raise UserError("the scenario has a deployment without a name")
        try:
            model = _model(row, engines, held, sizes, warm=warm)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise UserError(
                f"model {row['name']}: a setting in the scenario is not a number or name it "
                f"can be ({type(exc).__name__})"
            ) from None
        for host in (model.host, *(r.host for r in model.replica_set)):
            if host is not None and host not in sizes:
                raise UserError(f"model {model.name}: no host {host!r} in the scenario")
        models.append(model)
    adapters = scenario_adapters.build(data, models)
    return Scenario(hosts, models, name, server_mode=data.get("mode") == "server",
                    adapters=adapters, batch_keys=_batch_keys(data))  # fmt: skip


def _batch_keys(data: dict[str, Any]) -> frozenset[int]:
    """The keys a scenario's ``batch_keys`` lists (ids): their requests are batch."""
    listed = data.get("batch_keys") or []
    if not isinstance(listed, list):
        raise UserError("scenario: `batch_keys` must be a list of key ids")
    if not all(isinstance(k, int) and not isinstance(k, bool) for k in listed):
        raise UserError("scenario: `batch_keys` must be a list of key ids")
    return frozenset(listed)


def _host(row: dict[str, Any]) -> SimHost:
    pools = {str(p["pool"]): p for p in row.get("pools") or [] if isinstance(p, dict)}
    unified = bool(row.get("unified"))
    if unified:
        unified_pool = pools.get("unified", {})
        capacity = int(unified_pool.get("capacity_bytes") or row.get("ram_total_bytes") or 0)
        gpus, ram = [capacity], capacity
    else:
        gpus = [
            int(pools[name]["capacity_bytes"])
            for name in sorted((p for p in pools if p.startswith("gpu")), key=lambda p: int(p[3:]))
        ]
        ram = int(pools.get("ram", {}).get("capacity_bytes") or row.get("ram_total_bytes") or 0)
    foreign = {name: int(p.get("foreign_bytes") or 0) for name, p in pools.items()}
    online = row.get("state") != "unreachable"
    foreign = {k: v for k, v in foreign.items() if v}
    return SimHost(str(row.get("name")), gpus, ram, unified, foreign, online)


def _model(
    row: dict[str, Any],
    engines: dict[Any, dict[str, Any]],
    held: dict[str, list[str]],
    device_sizes: dict[str, int],
    *,
    warm: bool,
) -> SimModel:
    from capyctl.deployments.models import Deployment  # noqa: PLC0415
    from capyctl.engines.models import Engine  # noqa: PLC0415
    from capyctl.scheduler import estimates  # noqa: PLC0415
    from hostagent.kinds import KindError, get_kind  # noqa: PLC0415

    name = row["name"]
    kind = str(row.get("kind") or engines.get(row.get("engine"), {}).get("kind") or "custom")
    # The claim as a start works it out (DESIGN §6), from an unsaved row of these figures.
    deployment = Deployment(
        name=name,
        engine=Engine(name=str(row.get("engine") or "sim"), kind=kind),
        source=str(row.get("source") or ""),
        engine_args=list(row.get("engine_args") or []),
        gpu_memory_bytes=row.get("gpu_memory_bytes"),
        gpu_memory_fraction=row.get("gpu_memory_fraction"),
        weights_bytes=row.get("weights_bytes"),
        measured_gpu_bytes=row.get("measured_gpu_bytes"),
        measured_weights_bytes=row.get("measured_weights_bytes"),
        source_bytes=row.get("source_bytes"),
        gpus=int(row.get("gpus", 1)),
    )
    host = row.get("host")
    device = device_sizes.get(host) if host else min(device_sizes.values(), default=0)
    claim = estimates.claim_per_gpu(deployment, device or 0)
    weights = estimates.weights_bytes(deployment, claim * max(deployment.gpus, 1))
    if "can_park_ram" in row or "can_park_deep" in row:
        can_ram, can_deep = bool(row.get("can_park_ram")), bool(row.get("can_park_deep"))
    else:
        try:
            can = get_kind(kind).capabilities({})
            can_ram, can_deep = can.ram, can.deep
        except KindError:
            can_ram = can_deep = False
        if engines.get(row.get("engine"), {}).get("parks") == "no":
            can_ram = can_deep = False
    unverified = engines.get(row.get("engine"), {}).get("parks") == "kept memory"
    timings = Timings.for_kind(kind)
    for step, seconds in (row.get("timings") or {}).items():
        if step in TIMING_NAMES and isinstance(seconds, int | float) and seconds >= 0:
            setattr(timings, step, float(seconds))
    state = _start_state(row, warm)
    replicas, least = int(row.get("replicas") or 1), int(row.get("min_replicas") or 0)
    if not 1 <= replicas <= MAX_REPLICAS or not 0 <= least <= replicas:
        raise UserError(
            f"model {name}: replicas must be 1 to {MAX_REPLICAS} and min_replicas 0 to "
            f"replicas (got {replicas} and {least})"
        )
    spread = str(row.get("spread") or "hosts")
    if spread not in SPREAD_CHOICES:
        raise UserError(f"model {name}: spread is one of {', '.join(SPREAD_CHOICES)}")
    left = row.get("measured_residual_bytes")
    if left is not None and (not isinstance(left, int) or isinstance(left, bool) or left < 0):
        raise UserError(
            f"model {name}: measured_residual_bytes is a number of bytes or null (got {left!r})"
        )
    return SimModel(
        name=name,
        kind=kind,
        host=host,
        gpus=deployment.gpus,
        claim_bytes=claim,
        weights_bytes=weights,
        measured_residual_bytes=left,
        park=str(row.get("park") or "auto"),
        pinned=bool(row.get("pinned")),
        priority=int(row.get("priority") or 0),
        min_ready_seconds=float(row.get("min_ready_seconds") or 0),
        max_turn_seconds=float(row.get("max_turn_seconds") or 0),
        max_queue_seconds=float(
            row.get("max_queue_seconds") or row.get("wake_timeout_seconds") or 300
        ),
        max_waiting=int(row.get("max_waiting") or 256),
        idle_park_seconds=float(row.get("idle_park_seconds") or 0),
        replicas=replicas,
        min_replicas=least,
        target_concurrency=int(
            row.get("target_concurrency") or builtin_default("target_concurrency")
        ),
        scale_up_wait_seconds=float(
            row.get("scale_up_wait_seconds") or builtin_default("scale_up_wait_seconds")
        ),
        spread=spread,
        max_concurrency=max(int(row.get("max_concurrency") or 0), 0),
        adapter_slots=int(row.get("adapter_slots") or 0),
        can_park_ram=can_ram,
        can_park_deep=can_deep,
        parks_unverified=unverified,
        desired=str(row.get("desired_state") or "running"),
        aliases=[str(a) for a in row.get("aliases") or []],
        timings=timings,
        state=state,
        parked_mode=str(row.get("parked_mode") or "") if state == "parked" else "",
        pools=sorted(held.get(name, []), key=_pool_order) if state != "stopped" else [],
        replica_set=[_replica(row, n, held, warm=warm) for n in range(1, replicas)],
    )


def _start_state(row: dict[str, Any], warm: bool) -> str:
    """Where a deployment (or a replica's row) stands when the replay begins: as the
    ledger has it (ready or parked) where ``warm``, else stopped."""
    state = str(row.get("observed_state") or "stopped") if warm else "stopped"
    return state if state in ("ready", "parked") else "stopped"


def _replica(
    row: dict[str, Any], index: int, held: dict[str, list[str]], *, warm: bool
) -> SimReplica:
    """Replica ``index`` of the deployment ``row`` as its ``replica_set`` lists it. One
    not listed yet (more replicas than the deployment has) is stopped, on the
    deployment's host where a person chose it (``host_chosen``), else placed where it
    fits, as the server makes a new replica's row."""
    listed = next((r for r in _replica_rows(row) if r.get("index") == index), None)
    if listed is None:
        host = row.get("host") if row.get("host_chosen") else None
        return SimReplica(str(host) if host else None)
    state = _start_state(listed, warm)
    name = str(listed.get("name") or f"{row['name']}~{index}")
    return SimReplica(
        str(listed["host"]) if listed.get("host") else None,
        state,
        str(listed.get("parked_mode") or "") if state == "parked" else "",
        sorted(held.get(name, []), key=_pool_order) if state != "stopped" else [],
    )


def _pool_order(pool: str) -> tuple[int, str]:
    return (int(pool[3:]), pool) if pool.startswith("gpu") and pool[3:].isdigit() else (-1, pool)


def save(data: dict[str, Any], path: str) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
