"""Wake: a parked model's engine given its GPU memory back and woken.

:func:`wake` is the verb; :func:`admit_wake` the one step under the host lock that plans
and promises the memory (PARKED -> WAKING with its claim promised, or the victims to evict
first).
"""

from __future__ import annotations

import time

from capyctl.deployments.models import Deployment, ObservedState
from capyctl.hosts.models import Host
from capyctl.ledger.pools import device_total, read_ledger
from capyctl.ledger.services import InsufficientMemoryError, host_lock
from capyctl.scheduler import estimates, request_classes, snapshots, transitions, turns
from capyctl.scheduler.actions.common import (
    MAX_SWITCH_ROUNDS,
    instance_key,
    live_instance,
    load,
    states,
)
from capyctl.scheduler.actions.evict import make_room
from capyctl.scheduler.actions.start import start_engine
from capyctl.scheduler.actions.stop import end_engine_and_fail
from capyctl.scheduler.drivers import driver_for
from capyctl.scheduler.errors import EngineFailedError, NoCapacityError
from capyctl.scheduler.policy import (
    RAM,
    HostSnapshot,
    Need,
    NoCapacity,
    Victim,
    is_gpu_pool,
    plan,
    room_kept_for,
    standing,
    turn_refusal,
)
from hostagent.errors import EngineError


def wake(deployment: Deployment, actor: str) -> Deployment:
    """Wake a parked deployment (its flight held by the caller):

    1. its engine process and host; a parked model without one is started instead;
    2. its claim: what its engine was launched with, not today's setting (a sleeping
       engine wakes to the memory it was started to use);
    3. admitted on its own GPUs (:func:`admit_wake`: WAKING, the claim promised),
       evicting the victims the plan names, at most :data:`MAX_SWITCH_ROUNDS` rounds;
    4. the engine's wake, in the mode it was parked in, then its usage read;
    5. READY with the measured figures held (:func:`transitions.woke`).

    An engine that fails to wake is ended and the model failed with the reason.
    """
    host = deployment.host
    instance = live_instance(deployment)
    if host is None or instance is None:
        return start_engine(deployment, actor)
    started = time.monotonic()
    pools = snapshots.gpu_pools(host, list(instance.gpu_indices))
    claim = instance.claim_bytes
    if claim is None:
        claim = estimates.claim_per_gpu(deployment, device_total(host))
    for _round in range(MAX_SWITCH_ROUNDS):
        victims = admit_wake(deployment, host, pools, claim)
        if victims is None:
            return load(deployment.pk)  # woken, or stopped, by someone else meanwhile
        if not victims:
            break
        make_room(victims, actor, for_name=deployment.name)
    else:
        raise NoCapacityError(
            f"{deployment.name}: memory was not freed after {MAX_SWITCH_ROUNDS} rounds"
        )
    mode = deployment.parked_mode or RAM
    driver = driver_for(host)
    key = instance_key(instance)
    try:
        driver.wake(key, mode, deployment.setting("wake_timeout_seconds"))
        usage = driver.usage(key)
    except EngineError as exc:
        end_engine_and_fail(deployment, driver, instance, f"wake failed: {exc}", actor)
        raise EngineFailedError(f"{deployment.name}: wake failed: {exc}") from exc
    except Exception as exc:
        end_engine_and_fail(
            deployment, driver, instance, f"wake failed: {type(exc).__name__}: {exc}", actor
        )
        raise
    figures = snapshots.measured(host, pools, usage, claim)
    if transitions.woke(deployment, host, figures, mode, started=started, actor=actor):
        return deployment  # as the transition wrote it
    return load(deployment.pk)


def admit_wake(
    deployment: Deployment, host: Host, pools: list[str], claim: int
) -> tuple[Victim, ...] | None:
    """Under the host lock: if the claim fits back on its own GPUs, move PARKED -> WAKING
    and promise it (returns ``()``); else name who must make room. ``None``: it is no
    longer a parked model that should run (another caller woke or stopped it)."""
    with host_lock(host) as locked:  # the row this wake read (see host_lock)
        # Its own entries (held residual, or unconfirmed: they still count the whole claim)
        # are replaced by the promise, so they count as room for it. One read of the
        # host's entries serves the check, the promise and the plan.
        read = read_ledger(locked)
        mine = read.entries(deployment.pk)
        usage = {u.pool: u for u in read.usage()}
        if all(usage[p].free_bytes + mine.get(p, 0) >= claim for p in pools if p in usage):
            # It fits; but room freed for a model that has waited longer is kept for it.
            free = {p: u.free_bytes for p, u in usage.items() if is_gpu_pool(p)}
            taking = {p: claim - mine.get(p, 0) for p in pools}
            classes = request_classes.demand()
            batch = request_classes.batch_only(classes, deployment.pk,
                                               group=snapshots.siblings(deployment))  # fmt: skip
            standing_now = standing(turns.waited(deployment.pk), deployment.priority, batch)
            before = room_kept_for(snapshots.contenders(locked.pk, classes), deployment.pk,
                                   standing_now, free, taking)  # fmt: skip
            if before is not None:
                raise turns.refused(deployment.pk, deployment.name,
                                    turn_refusal(deployment.name, before, tuple(pools)),
                                    priority=deployment.priority, host_id=locked.pk,
                                    claim_bytes=claim)  # fmt: skip
            # waking() moves it only while it is still parked and wanted running (else: None)
            try:
                won = transitions.waking(locked, deployment, dict.fromkeys(pools, claim),
                                         read=read)  # fmt: skip
            except InsufficientMemoryError as exc:
                raise NoCapacityError(f"{deployment.name}: {exc}", lasting=False) from exc
            return () if won else None
        if states(deployment.pk) != (ObservedState.PARKED, "running"):
            return None
        classes = request_classes.demand()
        snap = snapshots.snapshot(locked, read, classes)
        residual = min((mine.get(p, 0) for p in pools), default=0)
        others = HostSnapshot(
            snap.host_id,
            snap.name,
            snap.unified,
            {p: snap.pools[p] for p in (*pools, snap.ram_pool) if p in snap.pools},
            [r for r in snap.residents if r.deployment_id != deployment.pk],
            contenders=snap.contenders,
        )
        group = snapshots.siblings(deployment)
        batch = request_classes.batch_only(classes, deployment.pk, group=group)
        need = Need(deployment.pk, deployment.name, len(pools), claim - residual, 0, (host.pk,),
                    turns.waited(deployment.pk), deployment.priority,
                    siblings=group, spread=deployment.spread, batch=batch)  # fmt: skip
        result = plan([others], need)
        if isinstance(result, NoCapacity):
            raise turns.refused(deployment.pk, deployment.name, result, pools=tuple(pools),
                                priority=deployment.priority, host_id=locked.pk,
                                claim_bytes=claim - residual)  # fmt: skip
        return result.victims or ()
