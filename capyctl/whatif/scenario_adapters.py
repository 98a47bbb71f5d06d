"""Adapters in a scenario: which models are LoRA adapters of which base, and how long a
load takes; the ``--set`` changes that turn models into adapters and back.

A scenario's ``adapters`` is a list of ``{"name", "base", "load_seconds", "loaded_on"}``
(``load_seconds`` left out: never measured, so
:data:`~capyctl.whatif.model.DEFAULT_ADAPTER_LOAD_SECONDS`; ``loaded_on``: the engines of
the base, NAME or NAME~N, that hold it, which a ``--warm`` replay begins with): the shape
of ``capyctl status --json``'s ``adapters``, whose other fields are ignored; a base's
``adapter_slots`` is its deployment's setting (``deployments[]``). :func:`current` takes
the live configuration's from that status, each with the median of its measured loads:
the ``adapter.loaded`` events' figures, or, where those are gone, the loads its engines
hold now (``LoadedAdapter.load_seconds``).

``--set PATTERN.adapter_of=BASE`` (PATTERN: a name, or a shell pattern like ``ft-*``;
the base itself is left out of a pattern) makes the models it names adapters of BASE;
where BASE is no model of the scenario it is added, a copy of the first of them (a
fine-tune's base is its size). ``--set PATTERN.adapter_of=`` makes adapters models of
their own again, each a copy of its base. These changes are made before the other
``--set`` changes, so that those may name the base they add (``BASE.adapter_slots=N``).
"""

from __future__ import annotations

import copy
import re
import statistics
from fnmatch import fnmatchcase
from typing import Any

from capyctl.deployments.settings_spec import MAX_ADAPTER_SLOTS
from capyctl.errors import UserError
from capyctl.whatif.model import DEFAULT_ADAPTER_LOAD_SECONDS, SimAdapter, SimModel

_LOADED_RE = re.compile(r" in (\d+(?:\.\d+)?) ms")


def matches(pattern: str, name: Any) -> bool:
    """Whether ``name`` is the one ``pattern`` names (``*``, ``ft-*``: a shell pattern)."""
    return isinstance(name, str) and fnmatchcase(name, pattern)


def rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The scenario's adapters (a list it may then change)."""
    found = data.get("adapters")
    if found is None:
        found = data["adapters"] = []
    if not isinstance(found, list) or not all(isinstance(r, dict) for r in found):
        raise UserError("the scenario's `adapters` is not a list of {name, base} objects")
    return found


# -- the live configuration ---------------------------------------------------------------------


def current(status: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every adapter of the live configuration (``status``: ``capyctl status --json``'s
    ``adapters``, read afresh where not given), with its base, the engines that hold it
    and its measured load."""
    if status is None:
        from capyctl.reports import adapter_data, all_adapters  # noqa: PLC0415 - Django only

        status = [adapter_data(view) for view in all_adapters()]
    measured = measured_loads()
    return [
        {"name": row["name"], "base": row["base"],
         **({"load_seconds": measured[row["name"]]} if row["name"] in measured else {}),
         **({"loaded_on": list(row["loaded_on"])} if row.get("loaded_on") else {})}
        for row in status
    ]  # fmt: skip


def measured_loads() -> dict[str, float]:
    """Per adapter, the median seconds of its loads: as its ``adapter.loaded`` events say
    (``... in 58 ms``), else as the loads its engines hold now recorded them."""
    from capyctl.deployments.models import LoadedAdapter  # noqa: PLC0415
    from capyctl.events.models import Event  # noqa: PLC0415

    events: dict[str, list[float]] = {}
    for name, message in (
        Event.objects.filter(kind="adapter.loaded").values_list("subject", "message").iterator()
    ):
        figure = _LOADED_RE.search(message or "")
        if name and figure is not None:
            events.setdefault(name, []).append(float(figure[1]) / 1000)
    held: dict[str, list[float]] = {}
    for name, seconds in LoadedAdapter.objects.values_list("adapter__name", "load_seconds"):
        if seconds and seconds > 0:
            held.setdefault(name, []).append(float(seconds))
    found = {**held, **events}
    return {name: round(statistics.median(values), 3) for name, values in found.items()}


# -- changes ---------------------------------------------------------------------------------


def turn(data: dict[str, Any], pattern: str, base: str | None, item: str) -> None:
    """``PATTERN.adapter_of=BASE`` (BASE None: back to models of their own), on ``data``."""
    from capyctl.validation import validate_name  # noqa: PLC0415

    deployments: list[dict[str, Any]] = data["deployments"]
    adapters = rows(data)
    by_name = {d.get("name"): d for d in deployments}
    if base is None:
        chosen = [a for a in adapters if matches(pattern, a.get("name"))]
        if not chosen:
            raise UserError(f"--set {item!r}: no adapter {pattern!r} in the scenario")
        for adapter in chosen:
            base_row = by_name.get(adapter.get("base"))
            if base_row is None:
                raise UserError(f"--set {item!r}: adapter {adapter.get('name')}'s base "
                                f"{adapter.get('base')!r} is not in the scenario")  # fmt: skip
            deployments.append(_copy(base_row, str(adapter["name"]), slots=0))
            adapters.remove(adapter)
        return
    if any(a.get("name") == base for a in adapters):
        raise UserError(f"--set {item!r}: {base} is an adapter; a base is a model")
    if pattern == base:
        raise UserError(f"--set {item!r}: a model cannot be an adapter of itself")
    chosen = [d for d in deployments if matches(pattern, d.get("name")) and d.get("name") != base]
    if not chosen:
        raise UserError(f"--set {item!r}: no model {pattern!r} in the scenario")
    bases = {a.get("base") for a in adapters}
    for row in chosen:
        if row.get("name") in bases:
            raise UserError(f"--set {item!r}: {row['name']} is the base of adapters; make "
                            "them models first, or leave it out")  # fmt: skip
    if base not in by_name:
        try:
            validate_name(base, what="base name")
        except UserError as exc:
            raise UserError(f"--set {item!r}: {exc}") from None
        deployments.append(_copy(chosen[0], base, slots=None))
    gone = set()
    for row in chosen:
        deployments.remove(row)
        adapters.append({"name": row["name"], "base": base})
        gone.add(row["name"])
    data["ledger"] = [e for e in data.get("ledger") or [] if e.get("deployment") not in gone]


def _copy(row: dict[str, Any], name: str, *, slots: int | None) -> dict[str, Any]:
    """A model of its own made from ``row``: its settings and timings, stopped."""
    made = copy.deepcopy(row)
    made["name"], made["aliases"], made["replica_set"] = name, [], []
    made["observed_state"], made["parked_mode"] = "stopped", None  # a row of the scenario's
    if slots is not None:
        made["adapter_slots"] = slots
    return made


def set_load(data: dict[str, Any], pattern: str, seconds: float, item: str) -> None:
    """``PATTERN.adapter_load_seconds=S``."""
    chosen = [a for a in rows(data) if matches(pattern, a.get("name"))]
    if not chosen:
        raise UserError(f"--set {item!r}: no adapter {pattern!r} in the scenario")
    for adapter in chosen:
        adapter["load_seconds"] = seconds


def refuse_for_adapter(data: dict[str, Any], name: str, field: str, item: str) -> None:
    """A model's setting given to an adapter: refused, saying what applies to it."""
    adapter = next((a for a in rows(data) if a.get("name") == name), None)
    if adapter is not None:
        raise UserError(
            f"--set {item!r}: {name} is an adapter of {adapter.get('base')}: only "
            f"adapter_of and adapter_load_seconds apply to it (its base's {field} is "
            f"{adapter.get('base')}.{field})"
        )


# -- building ---------------------------------------------------------------------------------


def build(data: dict[str, Any], models: list[SimModel]) -> list[SimAdapter]:
    """The scenario's adapters, checked against its models as the server checks a new one."""
    from hostagent.kinds import KindError, get_kind  # noqa: PLC0415

    by_name = {m.name: m for m in models}
    taken = set(by_name) | {alias for m in models for alias in m.aliases}
    found: list[SimAdapter] = []
    for row in rows(data):
        name, base = row.get("name"), row.get("base")
        if not isinstance(name, str) or not isinstance(base, str):
            raise UserError("the scenario has an adapter without a name or a base")
        if name in taken:
            raise UserError(f"adapter {name}: a model or adapter of the scenario has its name")
        taken.add(name)
        model = by_name.get(base)
        if model is None:
            raise UserError(f"adapter {name}: no model {base!r} in the scenario to be its base")
        if not 1 <= model.adapter_slots <= MAX_ADAPTER_SLOTS:
            raise UserError(
                f"adapter {name}: its base {base} has {model.adapter_slots} adapter slots; "
                f"give it 1 to {MAX_ADAPTER_SLOTS}: --set {base}.adapter_slots=N"
            )
        try:
            serves = get_kind(model.kind).capabilities({}).adapters
        except KindError:
            serves = False
        if not serves:
            raise UserError(f"adapter {name}: its base {base} runs a {model.kind} engine, which "
                            "cannot serve adapters")  # fmt: skip
        held = row.get("loaded_on") or []
        if not isinstance(held, list) or not all(isinstance(e, str) for e in held):
            raise UserError(f"adapter {name}: loaded_on is not a list of its base's engines")
        loaded_on = tuple(e for e in held if e.partition("~")[0] == base)
        seconds = row.get("load_seconds")
        if seconds is None:
            found.append(SimAdapter(name, base, DEFAULT_ADAPTER_LOAD_SECONDS, measured=False,
                                    loaded_on=loaded_on))  # fmt: skip
            continue
        if not isinstance(seconds, int | float) or isinstance(seconds, bool):
            raise UserError(f"adapter {name}: load_seconds {seconds!r} is not a timing value")
        if not 0 <= seconds <= 10**6:
            raise UserError(f"adapter {name}: load_seconds {seconds} is not a timing value")
        found.append(SimAdapter(name, base, float(seconds), measured=True, loaded_on=loaded_on))
    return found
