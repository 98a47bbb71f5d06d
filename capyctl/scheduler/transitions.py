"""Every change of a deployment's observed state and of the ledger: one function each.

A transition makes its conditional update (``UPDATE … WHERE observed_state IN
(expected)``), and, where memory moves, does it under the host lock together with the
ledger change; then it records the event and tells whoever waits. It returns whether it
won: a caller whose update matched nothing changed nothing, and decides again on the row as
it is now. Two callers can never both make the same change.

Nothing else writes ``observed_state``, an instance's state or a ledger entry
(``tests/test_layout.py`` holds the code to that): :mod:`operations` decides what to do,
:mod:`reconcile` finds out what is true, and both change state only through here. A ledger
entry itself is written only by :mod:`capyctl.ledger.services`' functions, which the
transitions call; they never change an entry through the ORM.

=================  ==========================================  ============================
transition         from                                        ledger
=================  ==========================================  ============================
downloading        stopped, failed                             —
download_stopped   downloading → stopped                       —
starting           stopped, failed, downloading                promise (under the lock)
ready              starting                                    measured figures, held
draining           ready                                       —
drain_abandoned    draining → ready                            —
parking            draining                                    a RAM copy promised
park_refused       parking → ready                             engine RAM measured again
parked             parking                                     measured (or unconfirmed)
waking             parked                                      promise (under the lock)
woke               waking → ready                              measured figures, held
stopping           any but stopped                             —
stopped            stopping                                    released
failed             the given states (none other of its         released
                   engines alive)
stuck              (state, since) as read → stopping           —
download_abandoned downloading → failed                        —
recovered          any live state → stopped                    released
release_confirmed  parked                                      unconfirmed → held
=================  ==========================================  ============================

A host's state changes here too (``local_host_seen``, ``host_unreachable``, with its models'
entries unconfirmed in the same transaction, ``host_answers``, ``host_removed`` with its
foreign entries), as do a deployment's desired state (``desired``) and a download's
progress line (``download_progress``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from capyctl.deployments.models import Deployment, Instance, ObservedState
from capyctl.events.models import Event
from capyctl.events.services import record_event
from capyctl.hosts.models import LOCAL_HOST_NAME, Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.pools import pool_usage
from capyctl.ledger.services import (
    InsufficientMemoryError,
    admit,
    held_again,
    host_held_again,
    host_lock,
    mark_host_unconfirmed,
    mark_unconfirmed,
    release,
    set_foreign,
    set_measured,
)
from capyctl.scheduler import notify, requests_in_progress, switches
from hostagent.units import format_size

logger = logging.getLogger("capyctl.scheduler")
Status = LedgerEntry.Status

# States a deployment passes through, and those it rests in while its engine lives.
LIVE = (
    ObservedState.STARTING,
    ObservedState.READY,
    ObservedState.DRAINING,
    ObservedState.PARKING,
    ObservedState.PARKED,
    ObservedState.WAKING,
    ObservedState.STOPPING,
)
UNREACHABLE_NOTE = "its host does not answer"


def _move(
    deployment_id: int,
    expected: Iterable[str],
    new: str,
    *,
    wanted: bool = False,
    since: datetime | None = None,
    instance_id: int | None = None,
    **fields: object,
) -> bool:
    """The conditional update: ``new`` only from one of ``expected`` (with ``wanted``, only
    while its desired state is running; with ``since``, only if it has not changed since;
    with ``instance_id``, only while no other engine process of it lives: a newer start's
    or wake's is not the caller's to change)."""
    rows = Deployment.objects.filter(pk=deployment_id, observed_state__in=list(expected))
    if wanted:
        rows = rows.filter(desired_state="running")
    if since is not None:
        rows = rows.filter(state_changed_at=since)
    if instance_id is not None:
        others = Instance.objects.filter(deployment_id=OuterRef("pk")).exclude(pk=instance_id)
        rows = rows.exclude(Exists(others.exclude(state=Instance.State.EXITED)))
    updated = rows.update(observed_state=new, state_changed_at=timezone.now(), **fields)
    if updated == 1 and new == ObservedState.READY:
        requests_in_progress.reopen(deployment_id)  # the drain gate, closed while it drained
    return updated == 1


def record(
    deployment: Deployment,
    kind: str,
    message: str,
    *,
    level: str = Event.Level.INFO,
    started: float | None = None,
    actor: str = "system",
    data: dict[str, object] | None = None,
) -> None:
    """The event of a transition (or of a decision about one)."""
    duration = int((time.monotonic() - started) * 1000) if started is not None else None
    switches.note(kind, deployment.name, duration, (data or {}).get("mode"))
    record_event(
        kind,
        message,
        subject=deployment.name,
        level=level,
        actor=actor,
        deployment_id=deployment.pk,
        host_id=deployment.host_id,
        duration_ms=duration,
        data=data,
    )


def _announce(deployment_id: int, **outcome: Any) -> None:
    """Tell the requests waiting on the deployment in other processes (server mode: the
    API's), once what was written is committed. Standalone's waiters await the operation
    itself; a caller that collects the switch tells them when it is done, with its steps."""
    if not settings.CELERY_TASK_ALWAYS_EAGER and not (outcome.get("ok") and switches.active()):
        transaction.on_commit(lambda: notify.announce(deployment_id, **outcome))


def _held(host: Host, deployment: Deployment, figures: Mapping[str, int], note: str) -> None:
    """Measured figures as held (under the host lock); an overshoot past a pool's capacity
    is reported."""
    over = set_measured(host, deployment.pk, figures, note=note)
    for pool, extra in over.items():
        message = (
            f"{deployment.name} uses {format_size(extra)} more in {pool} than the pool has room "
            "for; the pool's reserve is absorbing it"
        )
        logger.warning(message)
        record(deployment, "ledger.overshoot", message, level=Event.Level.WARNING)


def entries(host: Host, deployment_id: int) -> dict[str, int]:
    """The deployment's ledger entries on the host (pool -> bytes)."""
    return dict(
        LedgerEntry.objects.filter(host=host, deployment_id=deployment_id).values_list(
            "pool", "bytes"
        )
    )


# --- starting ----------------------------------------------------------------------------


def downloading(deployment: Deployment, host: Host) -> bool:
    """STOPPED/FAILED -> DOWNLOADING on ``host``, while it should run."""
    return _move(
        deployment.pk,
        [ObservedState.STOPPED, ObservedState.FAILED],
        ObservedState.DOWNLOADING,
        wanted=True,
        host=host,
        state_reason=f"downloading {deployment.source}",
    )


def starting(
    locked: Host,
    deployment: Deployment,
    figures: Mapping[str, int],
    gpu_indices: list[int],
    *,
    key: str,
    claim_bytes: int,
) -> Instance | None:
    """STOPPED/FAILED/DOWNLOADING -> STARTING with ``figures`` promised and its instance
    row made. Runs inside the :func:`host_lock` the placement was planned under, so the
    plan and the promise see the same ledger; an InsufficientMemoryError rolls all of it
    back. ``None``: another caller started or stopped it meanwhile."""
    if not _move(
        deployment.pk,
        [ObservedState.STOPPED, ObservedState.FAILED, ObservedState.DOWNLOADING],
        ObservedState.STARTING,
        wanted=True,
        host=locked,
        state_reason="",
    ):
        return None
    admit(locked, deployment.pk, figures, note="promised for a start")
    return Instance.objects.create(
        deployment=deployment,
        host=locked,
        launch_key="",
        key=key,
        claim_bytes=claim_bytes,
        gpu_indices=gpu_indices,
    )


def launched(
    instance: Instance,
    *,
    pid: int,
    port: int,
    api_key: str,
    log_path: str,
    socket_path: str = "",
) -> bool:
    """The instance's engine is running (on its Unix socket, or its loopback port: the
    other is empty); False: it was ended while it launched."""
    return bool(
        Instance.objects.filter(pk=instance.pk, state=Instance.State.LAUNCHING).update(
            pid=pid,
            port=port or None,
            socket_path=socket_path,
            launch_key=api_key,
            state=Instance.State.RUNNING,
            log_path=log_path,
        )
    )


def instance_exited(instance_id: int) -> None:
    Instance.objects.filter(pk=instance_id).exclude(state=Instance.State.EXITED).update(
        state=Instance.State.EXITED, ended_at=timezone.now()
    )


def _to_ready(
    deployment: Deployment,
    host: Host,
    expected: str,
    figures: Mapping[str, int],
    claim_bytes: int | None = None,
    **fields: Any,
) -> bool:
    """``expected`` -> READY under the host lock, the measured figures held in place of
    the promise (with ``claim_bytes``, its live instance's claim changed too), waiters
    told; whether this call won."""
    with host_lock(host.pk) as locked:
        won = _move(deployment.pk, [expected], ObservedState.READY, **fields)
        if won:
            if claim_bytes is not None:
                Instance.objects.filter(deployment_id=deployment.pk).exclude(
                    state=Instance.State.EXITED
                ).update(claim_bytes=claim_bytes)
            _held(locked, deployment, figures, "measured")
            _announce(deployment.pk, ok=True)
    return won


def ready(
    deployment: Deployment,
    host: Host,
    figures: Mapping[str, int],
    pools: list[str],
    *,
    started: float,
    actor: str,
    raised_claim: tuple[int, int] | None = None,
) -> bool:
    """STARTING -> READY with the measured figures held. ``raised_claim`` (was, raised to):
    its engine was measured past its claim and its ``over_claim`` setting is ``raise``: the
    claim per GPU is raised, for the running instance (its wakes) and the deployment
    (its next starts), in the same update, and an event says so."""
    measured = max((figures[p] for p in pools), default=None)
    fields: dict[str, Any] = {"measured_gpu_bytes": measured}
    new_claim = raised_claim[1] if raised_claim is not None else None
    if new_claim is not None:
        fields.update(gpu_memory_bytes=new_claim, gpu_memory_fraction=None)
    won = _to_ready(deployment, host, ObservedState.STARTING, figures, new_claim, **fields)
    if won and raised_claim is not None:
        was_bytes, raised_bytes = raised_claim
        message = (
            f"{deployment.name}'s engine holds {format_size(raised_bytes)} per GPU, more than "
            f"its claim of {format_size(was_bytes)}: its claim is raised to "
            f"{format_size(raised_bytes)} "
            "(over_claim raise)"
        )
        logger.warning(message)
        record(deployment, "deployment.claim_raised", message, level=Event.Level.WARNING,
               actor=actor, data={"claim_bytes": raised_bytes, "was_bytes": was_bytes})  # fmt: skip
    if won:
        record(
            deployment,
            "deployment.ready",
            f"{deployment.name} is ready on {host.name} ({', '.join(pools) or 'CPU'})",
            started=started,
            actor=actor,
            data={"pools": list(pools)},
        )
    return won


# --- draining and parking ----------------------------------------------------------------


def draining(deployment_id: int) -> bool:
    """READY -> DRAINING, and the gate closed: new requests wait for the next wake. False:
    it was not ready (someone else drains, parks or stops it), and nothing was closed."""
    if not _move(deployment_id, [ObservedState.READY], ObservedState.DRAINING):
        return False
    try:
        requests_in_progress.close(deployment_id)
    except requests_in_progress.CountsUnknown:  # Redis does not answer: no drain, it stays ready
        _move(deployment_id, [ObservedState.DRAINING], ObservedState.READY)
        raise
    return True


def drain_abandoned(
    deployment: Deployment, message: str = "", kind: str = "deployment.drain_timeout"
) -> bool:
    """DRAINING -> READY (its gate open again): a drain that timed out or was left."""
    won = _move(deployment.pk, [ObservedState.DRAINING], ObservedState.READY)
    if won and message:
        record(deployment, kind, message, level=Event.Level.WARNING)
    return won


def parking(locked: Host, deployment: Deployment, copy_bytes: int | None) -> bool | None:
    """DRAINING -> PARKING, under the host lock. ``copy_bytes``: a RAM park's weights copy,
    promised in host RAM here; returns None when it no longer fits (park deep instead:
    the state is PARKING all the same). False: it was no longer draining."""
    if not _move(deployment.pk, [ObservedState.DRAINING], ObservedState.PARKING):
        return False
    if copy_bytes is None:
        return True
    mine = entries(locked, deployment.pk)
    try:
        # admit() checks every pool before writing, so a refusal changes nothing.
        admit(
            locked,
            deployment.pk,
            {"ram": mine.get("ram", 0) + copy_bytes},
            note="promised for a copy",
            current_entries=mine,
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
    """PARKING -> READY: the engine could not park; its RAM is what it held before."""
    with host_lock(host.pk) as locked:
        won = _move(deployment.pk, [ObservedState.PARKING], ObservedState.READY)
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
    counted, as unconfirmed (``reason`` says why)."""
    with host_lock(host.pk) as locked:
        won = _move(
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
            _held(locked, deployment, figures, f"parked {mode}")
    if not won:
        return False
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
        won = _move(
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
            _held(locked, deployment, figures, "parked outside CapyCTL")
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
        if not Deployment.objects.filter(
            pk=deployment.pk, observed_state=ObservedState.PARKED
        ).update(state_reason=""):
            return False
        set_measured(locked, deployment.pk, figures)
        held_again(locked, deployment.pk)
    record(
        deployment,
        "deployment.released",
        f"the GPU probe now shows {deployment.name}'s parked memory released",
    )
    return True


# --- waking ------------------------------------------------------------------------------


def waking(
    locked: Host,
    deployment: Deployment,
    claim: Mapping[str, int],
    mine: Mapping[str, int] | None = None,
) -> bool:
    """PARKED -> WAKING with ``claim`` promised (its own entries, held or unconfirmed,
    replaced by the promise). Runs inside the :func:`host_lock` that checked the claim fits;
    an InsufficientMemoryError rolls it back. False: no longer parked, or no longer wanted.
    ``mine``: its entries, when the caller read them under this lock."""
    if mine is None:
        mine = entries(locked, deployment.pk)
    if not _move(deployment.pk, [ObservedState.PARKED], ObservedState.WAKING, wanted=True):
        return False
    admit(locked, deployment.pk, claim, note="promised", current_entries=mine)
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
    """WAKING -> READY with the measured figures held."""
    won = _to_ready(
        deployment, host, ObservedState.WAKING, figures, parked_mode="", state_reason=""
    )
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


# --- stopping and failing ----------------------------------------------------------------


def stopping(deployment_id: int, current: str) -> bool:
    """``current`` -> STOPPING (a new start waits until its memory is released)."""
    return _move(deployment_id, [current], ObservedState.STOPPING)


def stuck(deployment: Deployment) -> bool:
    """-> STOPPING from exactly the state and moment a reconcile pass read: if it moved on
    meanwhile (the slow step finished, another pass repaired it), nothing changes."""
    return _move(
        deployment.pk,
        [deployment.observed_state],
        ObservedState.STOPPING,
        since=deployment.state_changed_at,
    )


def stopped(
    deployment: Deployment,
    *,
    reason: str,
    level: str = Event.Level.INFO,
    started: float | None = None,
    actor: str = "system",
) -> bool:
    """STOPPING -> STOPPED, its engine ended: its memory released. False: it was no longer
    stopping (repaired meanwhile, or failed), and nothing changed."""
    if deployment.host_id is not None:
        with host_lock(deployment.host_id) as locked:
            won = _move(
                deployment.pk,
                [ObservedState.STOPPING],
                ObservedState.STOPPED,
                parked_mode="",
                state_reason=reason,
            )
            if won:
                release(locked, deployment.pk)
    else:
        won = _move(
            deployment.pk,
            [ObservedState.STOPPING],
            ObservedState.STOPPED,
            parked_mode="",
            state_reason=reason,
        )
    if not won:
        return False
    message = (
        reason
        if reason.startswith(f"stopped {deployment.name}")
        else f"stopped {deployment.name}: {reason}"
    )
    record(deployment, "deployment.stopped", message, level=level, started=started, actor=actor)
    return True


def failed(
    deployment: Deployment,
    reason: str,
    *,
    actor: str = "system",
    expected: Iterable[str] | None = None,
    level: str = Event.Level.ERROR,
    code: str = "engine_failed",
    engine_gone: bool = True,
    instance_id: int | None = None,
) -> bool:
    """-> FAILED with the reason, from ``expected`` (default: any state but failed, stopped
    or stopping); ``instance_id``: the engine process the caller drove, so it wins only
    while no other process of the deployment lives (a late failure of an old worker leaves
    a newer start or wake alone). Its engine is gone (the caller ended it, or none ran), so
    whatever it held is released, if this call won. ``engine_gone=False``: its process
    could not be ended, so what it held stays counted, as unconfirmed. A call that lost
    changes nothing. The state change only: it ends no engine
    (:func:`operations.end_engine_and_fail` ends it first, then calls this)."""
    states = (
        list(expected)
        if expected is not None
        else [
            s
            for s in ObservedState.values
            if s not in (ObservedState.FAILED, ObservedState.STOPPED, ObservedState.STOPPING)
        ]
    )
    fields: dict[str, Any] = {"state_reason": reason[:2000], "parked_mode": ""}
    if deployment.host_id is not None:
        with host_lock(deployment.host_id) as locked:
            won = _move(
                deployment.pk, states, ObservedState.FAILED, instance_id=instance_id, **fields
            )
            if won and engine_gone:
                release(locked, deployment.pk)
            elif won:
                mark_unconfirmed(locked, deployment.pk, "its engine could not be ended")
            if won:
                message = f"{deployment.name}: {reason}"
                _announce(deployment.pk, ok=False, code=code, message=message)
    else:
        won = _move(deployment.pk, states, ObservedState.FAILED, instance_id=instance_id, **fields)
    if won:
        record(deployment, "deployment.failed", f"{deployment.name} failed: {reason}",
               level=level, actor=actor)  # fmt: skip
    return won


def download_stopped(deployment: Deployment, *, actor: str) -> bool:
    """DOWNLOADING -> STOPPED on request: nothing was admitted or launched yet. The fetch
    goes on into the host's cache (the next start takes it from there); the start that
    waited for it gives up within half a second."""
    reason = f"stopped on request while downloading {deployment.source}"
    if not _move(
        deployment.pk,
        [ObservedState.DOWNLOADING],
        ObservedState.STOPPED,
        parked_mode="",
        state_reason=reason,
    ):
        return False
    record(deployment, "deployment.stopped", f"stopped {deployment.name}: {reason}", actor=actor)
    return True


def fetched_waits_for_room(deployment: Deployment, why: str) -> bool:
    """DOWNLOADING -> STOPPED: its weights are on the host, but there is no room for it yet
    (what is in the way will pass); the start that fetched them tries again, and a state
    nobody drives between its tries is not left passing."""
    reason = f"its weights are fetched; it waits for room: {why}"
    return _move(
        deployment.pk,
        [ObservedState.DOWNLOADING],
        ObservedState.STOPPED,
        parked_mode="",
        state_reason=reason,
    )


def download_abandoned(deployment: Deployment, reason: str) -> bool:
    """DOWNLOADING -> FAILED: the process that watched the download ended."""
    return failed(
        deployment,
        reason,
        expected=[ObservedState.DOWNLOADING],
        level=Event.Level.WARNING,
        code="unavailable",
    )


def recovered(deployment: Deployment, host: Host, *, shutting_down: bool) -> bool:
    """Any live (or failed) state -> STOPPED: its engine, of a run that ended (or of this
    one, at shutdown), was ended; its memory is released."""
    previous = deployment.observed_state
    with host_lock(host.pk) as locked:
        won = _move(
            deployment.pk,
            [previous],
            ObservedState.STOPPED,
            parked_mode="",
            state_reason=f"was {previous} when CapyCTL stopped; it starts again on demand",
        )
        if won:
            release(locked, deployment.pk)
    if not won:
        return False
    if shutting_down:
        record(deployment, "deployment.stopped", f"stopped {deployment.name}: CapyCTL stopped")
    elif previous != ObservedState.FAILED:
        record(
            deployment,
            "deployment.recovered",
            f"{deployment.name} was {previous} when CapyCTL last stopped; its engine was "
            "ended and it starts again on its next request",
        )
    return True


# --- the host as a whole -----------------------------------------------------------------


def foreign_measured(host: Host, figures: Mapping[str, int]) -> None:
    """Memory used by processes CapyCTL did not start, per pool, as the probe reads it; a
    figure never takes a pool past what CapyCTL's own entries leave."""
    with host_lock(host.pk) as locked:
        usage = {u.pool: u for u in pool_usage(locked)}
        allowed = {}
        for pool, foreign in figures.items():
            if pool not in usage:
                continue
            counted = usage[pool]
            room = counted.capacity_bytes - (counted.used_bytes - counted.foreign_bytes)
            allowed[pool] = min(foreign, max(room, 0))
        set_foreign(locked, allowed)


def local_host_seen(inventory: Mapping[str, Any]) -> tuple[Host, bool]:
    """The in-process host ``local``, made or refreshed with what the probe sees now:
    online. Returns it, and whether it was made now."""
    now = timezone.now()
    seen = {"is_local": True, "state": Host.State.ONLINE, "inventory": dict(inventory),
            "last_seen_at": now}  # fmt: skip
    with transaction.atomic():
        host, created = Host.objects.get_or_create(name=LOCAL_HOST_NAME, defaults=seen)
        if not created:
            Host.objects.filter(pk=host.pk).update(**seen)
            host.refresh_from_db()
    return host, created


def host_unreachable(host: Host) -> bool:
    """-> UNREACHABLE, and what the host's models hold stays counted, as memory nobody can
    confirm now: both in one transaction. False: it was unreachable already."""
    with host_lock(host.pk) as locked:
        rows = Host.objects.filter(pk=locked.pk).exclude(state=Host.State.UNREACHABLE)
        if not rows.update(state=Host.State.UNREACHABLE):
            return False
        mark_host_unconfirmed(locked, UNREACHABLE_NOTE)
    return True


def host_answers(host: Host, inventory: Mapping[str, Any], *, pin: str) -> str | None:
    """-> ONLINE with the ``inventory`` it reported, only while it still holds the
    certificate ``pin`` the call trusted (a revoke that landed meanwhile is not undone).
    If it was unreachable, what was unconfirmed for that reason counts as held again
    (reconcile then finds out which engines are still there). Returns the state it was in;
    None: its certificate changed meanwhile, and nothing changed."""
    with host_lock(host.pk) as locked:
        rows = Host.objects.filter(pk=locked.pk, cert_fingerprint=pin).exclude(cert_fingerprint="")
        if not rows.update(
            state=Host.State.ONLINE, inventory=dict(inventory), last_seen_at=timezone.now()
        ):
            return None
        if locked.state == Host.State.UNREACHABLE:
            host_held_again(locked, UNREACHABLE_NOTE)
    return str(locked.state)


def host_removed(host: Host) -> None:
    """The host is forgotten, with the memory its ledger counted as foreign (no model is
    placed on it, so it counts nothing else: the caller checked)."""
    with host_lock(host.pk) as locked:
        pools = LedgerEntry.objects.filter(host=locked, deployment__isnull=True)
        set_foreign(locked, dict.fromkeys(pools.values_list("pool", flat=True), 0))
        locked.delete()


# --- people's intent ---------------------------------------------------------------------


def desired(deployment_id: int, value: str) -> None:
    """A person's intent for the deployment: ``running`` or ``stopped`` (its desired state;
    the scheduler acts on it)."""
    Deployment.objects.filter(pk=deployment_id).update(desired_state=value)


def download_progress(deployment: Deployment, data: Mapping[str, Any], line: str) -> bool:
    """While it downloads: the fetch's progress (``download``) and its line in
    ``state_reason``. False: it no longer downloads, and nothing changed."""
    rows = Deployment.objects.filter(pk=deployment.pk, observed_state=ObservedState.DOWNLOADING)
    return bool(rows.update(download=dict(data), state_reason=line))
