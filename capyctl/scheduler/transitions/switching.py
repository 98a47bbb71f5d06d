"""Transitions of a switch: draining, parking (a RAM copy promised), parked, waking (the
claim promised), woke, and a park's memory confirmed released.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db.models import Q

from capyctl.deployments.models import Deployment, ObservedState
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.pools import LedgerRead, read_ledger
from capyctl.ledger.services import (
    InsufficientMemoryError,
    admit,
    held_again,
    host_lock,
    mark_unconfirmed,
    set_measured,
)
from capyctl.scheduler import requests_in_progress
from capyctl.scheduler.transitions.base import (
    Status,
    entries,
    hold_measured,
    move,
    record,
    to_ready,
)
from hostagent.units import format_size


def draining(deployment_id: int) -> bool:
    """READY -> DRAINING, and the gate closed: new requests wait for the next wake. False:
    it was not ready (someone else drains, parks or stops it), and nothing was closed."""
    if not move(deployment_id, [ObservedState.READY], ObservedState.DRAINING):
        return False
    try:
        requests_in_progress.close(deployment_id)
    except requests_in_progress.CountsUnknown:  # Redis does not answer: no drain, it stays ready
        move(deployment_id, [ObservedState.DRAINING], ObservedState.READY)
        raise
    return True


def drain_abandoned(
    deployment: Deployment, message: str = "", kind: str = "deployment.drain_timeout"
) -> bool:
    """DRAINING -> READY (its gate open again): a drain that timed out or was left."""
    won = move(deployment.pk, [ObservedState.DRAINING], ObservedState.READY)
    if won and message:
        record(deployment, kind, message, level=Event.Level.WARNING)
    return won


def parking(
    locked: Host, deployment: Deployment, copy_bytes: int | None, read: LedgerRead | None = None
) -> bool | None:
    """DRAINING -> PARKING, under the host lock. ``copy_bytes``: a RAM park's weights copy,
    promised in host RAM here; returns None when it no longer fits (park deep instead:
    the state is PARKING all the same). False: it was no longer draining. ``read``: the
    host's entries, when the caller read them under this lock."""
    if not move(deployment.pk, [ObservedState.DRAINING], ObservedState.PARKING):
        return False
    if copy_bytes is None:
        return True
    if read is None:
        read = read_ledger(locked)  # its entries and the pools' usage, in one query
    try:
        # admit() checks every pool before writing, so a refusal changes nothing.
        admit(
            locked,
            deployment.pk,
            {"ram": read.entries(deployment.pk).get("ram", 0) + copy_bytes},
            note="promised for a copy",
            read=read,
        )
    except InsufficientMemoryError:
        record(
            deployment,
            "deployment.park_mode",
            f"parking {deployment.name} deep: its copy ({format_size(copy_bytes)}) no longer "
            "fits in host RAM",
        )
        return None
    return True


def park_refused(deployment: Deployment, host: Host, engine_ram: int) -> bool:
    """PARKING -> READY: the engine could not park; its RAM is what it held before
    (``host``: as the park read it, see :func:`host_lock`)."""
    with host_lock(host) as locked:
        won = move(deployment.pk, [ObservedState.PARKING], ObservedState.READY)
        if won:
            set_measured(locked, deployment.pk, {"ram": engine_ram}, note="measured")
    return won


def parked(
    deployment: Deployment,
    host: Host,
    mode: str,
    figures: Mapping[str, int] | None,
    *,
    reason: str,
    started: float,
    actor: str,
    **remembered: Any,
) -> bool:
    """PARKING -> PARKED in ``mode``. ``figures``: what the probe measured it holding now;
    None: the engine answered but its memory is not seen free, so what it held stays
    counted, as unconfirmed (``reason`` says why). ``host``: as the park read it (see
    :func:`host_lock`)."""
    with host_lock(host) as locked:
        won = move(
            deployment.pk,
            [ObservedState.PARKING],
            ObservedState.PARKED,
            parked_mode=mode,
            state_reason=reason,
            **remembered,
        )
        if won and figures is None:
            mark_unconfirmed(locked, deployment.pk, "park answered, memory not seen free")
        elif won and figures is not None:
            hold_measured(locked, deployment, figures, f"parked {mode}")
    if not won:
        return False
    if deployment.replicas > 1 or deployment.replica_of_id is not None:
        # The same weights on the same engine: a replica's measured copy sizes its
        # siblings' first ram parks, and what its park left is counted on for theirs.
        first = deployment.replica_of_id or deployment.pk
        siblings = Deployment.objects.filter(Q(pk=first) | Q(replica_of_id=first))
        for field in ("measured_weights_bytes", "measured_residual_bytes"):
            if remembered.get(field):
                siblings.filter(**{f"{field}__isnull": True}).update(**{field: remembered[field]})
    if figures is None:
        record(
            deployment,
            "deployment.parked",
            f"{deployment.name} parked ({mode}) but its memory is not confirmed released: {reason}",
            level=Event.Level.WARNING,
            started=started,
            actor=actor,
            data={"mode": mode},
        )
    else:
        record(
            deployment,
            "deployment.parked",
            f"parked {deployment.name} ({mode})" + (f" {reason}" if reason else ""),
            started=started,
            actor=actor,
            data={"mode": mode},
        )
    return True


def parked_unasked(
    deployment: Deployment, host: Host, figures: Mapping[str, int] | None, *, said: str
) -> bool:
    """READY -> PARKED (``deep``): its engine says it is parked, but CapyCTL did not park
    it (``said``: how the engine put it). Only from the READY it was read in, unchanged
    since. ``figures``: what it holds now, measured; None: not measured, so what it held
    stays counted, as unconfirmed. A wake reloads it as after a deep park."""
    reason = f"parked by something other than CapyCTL: its engine says {said}"
    with host_lock(host.pk) as locked:
        won = move(
            deployment.pk,
            [ObservedState.READY],
            ObservedState.PARKED,
            since=deployment.state_changed_at,
            parked_mode="deep",
            state_reason=reason,
        )
        if won and figures is None:
            mark_unconfirmed(locked, deployment.pk, "parked outside CapyCTL, memory not measured")
        elif won and figures is not None:
            hold_measured(locked, deployment, figures, "parked outside CapyCTL")
    if won:
        record(
            deployment,
            "deployment.parked_unasked",
            f"{deployment.name} was ready, but its engine says {said}: someone parked it "
            "without CapyCTL (a local user reaching its engine?). It is counted as parked "
            "deep; its next request wakes it",
            level=Event.Level.WARNING,
            data={"mode": "deep"},
        )
    return won


def release_confirmed(deployment: Deployment, host: Host, figures: Mapping[str, int]) -> bool:
    """A parked deployment's unconfirmed memory, now seen free: its measured figures are
    held again. False: it is no longer parked (a wake's promise is not touched)."""
    with host_lock(host.pk) as locked:
        unconfirmed = LedgerEntry.objects.filter(
            host=locked, deployment=deployment, status=Status.UNCONFIRMED
        ).exists()
        if not unconfirmed:
            return False
        # What it left on its GPUs, remembered as a park's is (see actions.park_ready).
        most = max((b for pool, b in figures.items() if pool != "ram"), default=0)
        deep_if_unified = deployment.parked_mode == "deep" or "unified" not in figures
        remembered = {"measured_residual_bytes": most} if most > 0 and deep_if_unified else {}
        if not Deployment.objects.filter(
            pk=deployment.pk, observed_state=ObservedState.PARKED
        ).update(state_reason="", **remembered):
            return False
        set_measured(locked, deployment.pk, figures)
        held_again(locked, deployment.pk)
    record(
        deployment,
        "deployment.released",
        f"the GPU probe now shows {deployment.name}'s parked memory released",
    )
    return True


def waking(
    locked: Host,
    deployment: Deployment,
    claim: Mapping[str, int],
    mine: Mapping[str, int] | None = None,
    read: LedgerRead | None = None,
) -> bool:
    """PARKED -> WAKING with ``claim`` promised (its own entries, held or unconfirmed,
    replaced by the promise). Runs inside the :func:`host_lock` that checked the claim fits;
    an InsufficientMemoryError rolls it back. False: no longer parked, or no longer wanted.
    ``mine``: its entries, when the caller read them under this lock; ``read``: the host's
    entries, read under this lock (its own and the pools' usage)."""
    if mine is None and read is None:
        mine = entries(locked, deployment.pk)
    if not move(deployment.pk, [ObservedState.PARKED], ObservedState.WAKING, wanted=True):
        return False
    admit(locked, deployment.pk, claim, note="promised", current_entries=mine, read=read)
    return True


def woke(
    deployment: Deployment,
    host: Host,
    figures: Mapping[str, int],
    mode: str,
    *,
    started: float,
    actor: str,
) -> bool:
    """WAKING -> READY with the measured figures held; ``deployment`` is given what was
    written when it wins."""
    won = to_ready(
        deployment, host, ObservedState.WAKING, figures,
        row=deployment, parked_mode="", state_reason="",
    )  # fmt: skip
    if won:
        record(
            deployment,
            "deployment.woke",
            f"woke {deployment.name} from {mode}",
            started=started,
            actor=actor,
            data={"mode": mode, "pools": sorted(p for p in figures if p != "ram")},
        )
    return won


def engine_ram_measured(deployment: Deployment, host: Host, ram_bytes: int, note: str) -> bool:
    """What a ready engine holds in host RAM, measured again after it loaded or unloaded an
    adapter (an engine caches its adapters there): held, in place of the last figure.
    False: it is no longer ready (a switch measures it itself)."""
    with host_lock(host) as locked:
        if not Deployment.objects.filter(
            pk=deployment.pk, observed_state=ObservedState.READY
        ).exists():
            return False
        hold_measured(locked, deployment, {"ram": ram_bytes}, note)
    return True
