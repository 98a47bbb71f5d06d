"""The scheduler's operations: the only code that changes observed state and the ledger.

Each is a plain function over ids, safe to call twice. Observed state changes only by
conditional updates (``UPDATE … WHERE observed_state IN (expected)``), so two callers can
never both run the same transition: the one whose update matched does the work, the other
waits for its outcome. Memory is admitted in the ledger under the host lock before an
engine starts or wakes, and replaced by the probe's measured figures once it is ready.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from capyctl.deployments.models import Deployment, Instance, ObservedState
from capyctl.errors import UserError
from capyctl.events.models import Event
from capyctl.events.services import record_event
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.pools import pool_usage
from capyctl.ledger.services import (
    admit,
    host_lock,
    mark_unconfirmed,
    release,
    set_measured,
)
from capyctl.scheduler import estimates, inflight, snapshots
from capyctl.scheduler.drivers import HostDriver, driver_for
from capyctl.scheduler.policy import (
    DEEP,
    RAM,
    STOP,
    HostSnapshot,
    Need,
    NoCapacity,
    Placement,
    Pool,
    Victim,
    park_mode,
    plan,
)
from hostagent.errors import CannotParkError, EngineError, MemoryNotReleasedError
from hostagent.runtime import InstanceRequest
from hostagent.units import format_size

logger = logging.getLogger("capyctl.scheduler")
S = ObservedState

MAX_SWITCH_ROUNDS = 4
STOP_GRACE_SECONDS = 10.0


class SchedulerError(UserError):
    """An operation could not be done; ``code`` is the OpenAI-style error code."""

    code = "scheduler_error"


class NoCapacityError(SchedulerError):
    code = "no_capacity"

    def __init__(self, message: str, blockers: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.blockers = tuple(blockers)


class ModelStoppedError(SchedulerError):
    code = "model_stopped"


class EngineFailedError(SchedulerError):
    code = "engine_failed"


# --- state ------------------------------------------------------------------------------

_flights: dict[int, threading.Lock] = {}
_flights_lock = threading.Lock()


def _flight(deployment_id: int) -> threading.Lock:
    with _flights_lock:
        return _flights.setdefault(deployment_id, threading.Lock())


def flight_free(deployment_id: int) -> bool:
    """Whether no start or wake of the deployment is under way in this process."""
    flight = _flight(deployment_id)
    if flight.acquire(blocking=False):
        flight.release()
        return True
    return False


def _transition(deployment_id: int, expected: Iterable[str], new: str, **fields: object) -> bool:
    """Move to ``new`` only from one of ``expected``; return whether this call did it."""
    updated = Deployment.objects.filter(pk=deployment_id, observed_state__in=list(expected)).update(
        observed_state=new, state_changed_at=timezone.now(), **fields
    )
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
    duration = int((time.monotonic() - started) * 1000) if started is not None else None
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


def _load(deployment_id: int) -> Deployment:
    try:
        return Deployment.objects.select_related("engine", "host").get(pk=deployment_id)
    except Deployment.DoesNotExist:
        raise SchedulerError(f"deployment {deployment_id} no longer exists") from None


def _live_instance(deployment: Deployment) -> Instance | None:
    return (
        Instance.objects.filter(deployment_id=deployment.pk)
        .exclude(state=Instance.State.EXITED)
        .only("pk", "pid", "port", "gpu_indices", "log_path", "state")
        .first()
    )


# --- making room ---------------------------------------------------------------------------


def _place(deployment: Deployment, actor: str) -> tuple[Host, Placement]:
    """Choose the host and pools, evicting victims until the need fits; admit it."""
    hosts: list[Host] = [deployment.host] if deployment.host else list(Host.objects.all())
    for _round in range(MAX_SWITCH_ROUNDS):
        result: Placement | NoCapacity = NoCapacity(f"no host can run {deployment.name}")
        chosen_host: Host | None = None
        for host in hosts:
            with host_lock(host.pk) as locked:
                result = plan([snapshots.snapshot(locked)], snapshots.need(deployment, locked))
                if isinstance(result, NoCapacity):
                    continue
                chosen_host = locked
                if not result.victims:
                    pools = snapshots.gpu_pools(locked, result.gpu_indices)
                    need = snapshots.need(deployment, locked)
                    figures = dict.fromkeys(pools, need.claim_per_gpu_bytes)
                    figures[snapshots.ram_pool(locked)] = (
                        figures.get(snapshots.ram_pool(locked), 0) + need.host_ram_bytes
                    )
                    admit(locked, deployment.pk, figures, note="promised for a start or wake")
                    return locked, result
                for victim in result.victims:
                    _transition(victim.deployment_id, [S.READY], S.DRAINING)
            break
        if isinstance(result, NoCapacity):
            raise NoCapacityError(result.reason, result.blockers)
        assert chosen_host is not None  # noqa: S101 - set together with a Placement
        for victim in result.victims:
            _evict(victim, actor, for_name=deployment.name)
    raise NoCapacityError(
        f"{deployment.name}: memory was not freed after {MAX_SWITCH_ROUNDS} rounds"
    )


def _evict(victim: Victim, actor: str, *, for_name: str) -> None:
    deployment = _load(victim.deployment_id)
    if victim.mode == STOP:
        drain = deployment.setting("drain_timeout_seconds")
        if not inflight.wait_drained(deployment.pk, drain):
            _transition(deployment.pk, [S.DRAINING], S.READY)
            raise SchedulerError(
                f"gave up stopping {deployment.name}: requests still in flight after {drain}s"
            )
        level = Event.Level.WARNING if "copy" in victim.reason else Event.Level.INFO
        message = f"stopped {deployment.name} instead of parking: {victim.reason}"
        logger.warning(message) if level == Event.Level.WARNING else logger.info(message)
        _stop(deployment, actor, reason=f"{message} (to make room for {for_name})", level=level)
    else:
        _park(deployment, victim.mode, actor=actor, reason=f"to make room for {for_name}")


# --- operations ----------------------------------------------------------------------------


def ensure_ready(
    deployment_id: int, actor: str = "system", timeout: float | None = None
) -> Deployment:
    """Make the deployment ready (start it, or wake it), evicting others if needed.

    Any number of concurrent calls for one deployment cause one start or wake; the others
    wait for it and share its outcome.
    """
    deployment = _load(deployment_id)
    if deployment.desired_state == "stopped":
        raise ModelStoppedError(f"{deployment.name} is stopped; start it first")
    if deployment.observed_state == S.READY:
        return deployment
    deadline = time.monotonic() + (timeout or deployment.setting("wake_timeout_seconds"))
    flight = _flight(deployment_id)
    while True:
        observed = (
            Deployment.objects.filter(pk=deployment_id)
            .values_list("observed_state", flat=True)
            .first()
        )
        if observed == S.READY:
            return _load(deployment_id)
        if flight.acquire(timeout=0.05):
            try:
                now_state = (
                    Deployment.objects.filter(pk=deployment_id)
                    .values_list("observed_state", "parked_mode")
                    .first()
                )
                if now_state is None:
                    raise SchedulerError(f"deployment {deployment_id} no longer exists")
                if now_state != (deployment.observed_state, deployment.parked_mode):
                    deployment = _load(deployment_id)
                if deployment.observed_state in (S.STOPPED, S.FAILED):
                    return _start(deployment, actor)
                if deployment.observed_state == S.PARKED:
                    return _wake(deployment, actor)
            finally:
                flight.release()
        if time.monotonic() >= deadline:
            raise SchedulerError(
                f"{deployment.name} is still {deployment.observed_state} after waiting"
            )
        time.sleep(0.05)


def start(deployment_id: int, actor: str = "system") -> Deployment:
    """The person's intent "run it": desired running, then ready."""
    Deployment.objects.filter(pk=deployment_id).update(desired_state="running")
    return ensure_ready(deployment_id, actor)


def _start(deployment: Deployment, actor: str) -> Deployment:
    started = time.monotonic()
    host, placement = _place(deployment, actor)
    instance_id = f"{deployment.name}-{uuid.uuid4().hex[:8]}"
    with transaction.atomic():
        if not _transition(
            deployment.pk, [S.STOPPED, S.FAILED], S.STARTING, host=host, state_reason=""
        ):
            with host_lock(host.pk) as locked:
                release(locked, deployment.pk)
            return _load(deployment.pk)
        instance = Instance.objects.create(
            deployment=deployment,
            host=host,
            launch_key="",
            gpu_indices=placement.gpu_indices,
            log_path=instance_id,
        )
    deployment = _load(deployment.pk)
    record(
        deployment, "deployment.starting", f"starting {deployment.name} on {host.name}", actor=actor
    )
    driver = driver_for(host)
    claim = estimates.claim_per_gpu(deployment, snapshots.device_total(host))
    request = InstanceRequest(
        instance_id=instance_id,
        kind=deployment.engine.kind,
        command=deployment.engine.command,
        source=deployment.source,
        served_name=deployment.name,
        extra_args=list(deployment.engine_args),
        gpu_indices=placement.gpu_indices if deployment.gpus else [],
        env=dict(deployment.engine.env),
        options=dict(deployment.engine.options),
        ram_park=deployment.park in ("auto", "ram") and not (host.inventory or {}).get("unified"),
        memory_fraction=estimates.memory_fraction(deployment, snapshots.device_total(host)),
    )
    try:
        launched = driver.launch(request)
        Instance.objects.filter(pk=instance.pk).update(
            pid=launched.pid,
            port=launched.port,
            launch_key=launched.api_key,
            state=Instance.State.RUNNING,
            log_path=str(launched.process.log_path),
        )
        driver.wait_ready(instance_id, deployment.setting("start_timeout_seconds"))
        usage = driver.usage(instance_id)
    except EngineError as exc:
        fail(deployment, driver, instance, f"the engine failed to start: {exc}", actor)
        raise EngineFailedError(f"{deployment.name}: the engine failed to start: {exc}") from exc
    pools = snapshots.gpu_pools(host, placement.gpu_indices)
    figures = snapshots.measured(host, pools, usage, claim)
    with host_lock(host.pk) as locked:
        _record_measured(locked, deployment, figures, "measured")
        _transition(
            deployment.pk,
            [S.STARTING],
            S.READY,
            measured_gpu_bytes=max((figures[p] for p in pools), default=None),
        )
    deployment = _load(deployment.pk)
    record(
        deployment,
        "deployment.ready",
        f"{deployment.name} is ready on {host.name} ({', '.join(pools) or 'CPU'})",
        started=started,
        actor=actor,
    )
    return deployment


def _record_measured(
    host: Host, deployment: Deployment, figures: dict[str, int], note: str
) -> None:
    """Held figures from the probe; an overshoot past a pool's capacity is reported."""
    over = set_measured(host, deployment.pk, figures, note=note)
    for pool, extra in over.items():
        message = (
            f"{deployment.name} uses {format_size(extra)} more in {pool} than the pool has room "
            "for; the pool's reserve is absorbing it"
        )
        logger.warning(message)
        record(deployment, "ledger.overshoot", message, level=Event.Level.WARNING)


def fail(
    deployment: Deployment,
    driver: HostDriver,
    instance: Instance | None,
    reason: str,
    actor: str,
) -> None:
    """End the engine, release its memory once the process is gone, mark it failed."""
    if instance is not None:
        driver.stop(instance_key(instance), 2.0)
        Instance.objects.filter(pk=instance.pk).update(
            state=Instance.State.EXITED, ended_at=timezone.now()
        )
    host = Host.objects.get(pk=deployment.host_id) if deployment.host_id else None
    if host is not None:
        with host_lock(host.pk) as locked:
            release(locked, deployment.pk)
    _transition(
        deployment.pk,
        [s for s in S.values if s != S.FAILED],
        S.FAILED,
        state_reason=reason[:2000],
        parked_mode="",
    )
    record(
        deployment,
        "deployment.failed",
        f"{deployment.name} failed: {reason}",
        level=Event.Level.ERROR,
        actor=actor,
    )


def instance_key(instance: Instance) -> str:
    """The runtime's name for an instance (the stem of its log file)."""
    return instance.log_path.rsplit("/", 1)[-1].removesuffix(".log")


def park(
    deployment_id: int, mode: str | None = None, *, actor: str = "system", reason: str = ""
) -> Deployment:
    """Give back the deployment's GPU memory in ``mode`` (None: the best mode it allows)."""
    _park(_load(deployment_id), mode, actor=actor, reason=reason)
    return _load(deployment_id)


def _park(deployment: Deployment, mode: str | None, *, actor: str, reason: str) -> None:
    host = deployment.host
    instance = _live_instance(deployment)
    if host is None or instance is None or deployment.observed_state not in (S.READY, S.DRAINING):
        raise SchedulerError(
            f"{deployment.name} is {deployment.observed_state}; only a ready model can be parked"
        )
    if mode is None:
        snap = snapshots.snapshot(host)
        resident = next((r for r in snap.residents if r.deployment_id == deployment.pk), None)
        ram_free = snap.pools[snap.ram_pool].free_bytes if snap.ram_pool in snap.pools else 0
        mode = park_mode(resident, snap, ram_free)[0] if resident else STOP
        if mode == STOP:
            _stop(deployment, actor, reason="its engine cannot park, so it was stopped")
            return
    started = time.monotonic()
    if deployment.observed_state == S.READY:
        _transition(deployment.pk, [S.READY], S.DRAINING)
    drain = deployment.setting("drain_timeout_seconds")
    if not inflight.wait_drained(deployment.pk, drain):
        left = inflight.count(deployment.pk)
        _transition(deployment.pk, [S.DRAINING], S.READY)
        message = (
            f"gave up parking {deployment.name}: {left} request(s) still in flight after {drain}s"
        )
        record(deployment, "deployment.drain_timeout", message, level=Event.Level.WARNING)
        raise SchedulerError(message)
    if not _transition(deployment.pk, [S.DRAINING], S.PARKING):
        return
    driver = driver_for(host)
    key = instance_key(instance)
    try:
        residual = driver.park(key, mode, deployment.setting("drain_timeout_seconds") + 600)
    except CannotParkError as exc:
        _transition(deployment.pk, [S.PARKING], S.READY)
        raise SchedulerError(f"{deployment.name}: {exc}") from exc
    except MemoryNotReleasedError as exc:
        with host_lock(host.pk) as locked:
            mark_unconfirmed(locked, deployment.pk, "park answered, memory not seen released")
        _transition(deployment.pk, [S.PARKING], S.PARKED, parked_mode=mode, state_reason=str(exc))
        record(
            deployment,
            "deployment.parked",
            f"{deployment.name} parked ({mode}) but its memory is not confirmed released: {exc}",
            level=Event.Level.WARNING,
            started=started,
            actor=actor,
        )
        return
    except EngineError as exc:
        fail(deployment, driver, instance, f"park failed: {exc}", actor)
        raise EngineFailedError(f"{deployment.name}: park failed: {exc}") from exc
    pools = snapshots.gpu_pools(host, list(instance.gpu_indices))
    figures = snapshots.measured(host, pools, residual, 0)
    remembered: dict[str, object] = {}
    with host_lock(host.pk) as locked:
        if mode == RAM and "ram" in figures:
            # The weights copy, measured: what host RAM grew by when the weights moved there.
            before = (
                LedgerEntry.objects.filter(host=locked, deployment=deployment, pool="ram")
                .values_list("bytes", flat=True)
                .first()
            )
            if before is not None and figures["ram"] > before:
                remembered["measured_weights_bytes"] = figures["ram"] - before
        _record_measured(locked, deployment, figures, f"parked {mode}")
        _transition(
            deployment.pk,
            [S.PARKING],
            S.PARKED,
            parked_mode=mode,
            state_reason=reason,
            **remembered,
        )
    record(
        deployment,
        "deployment.parked",
        f"parked {deployment.name} ({mode})" + (f" {reason}" if reason else ""),
        started=started,
        actor=actor,
        data={"mode": mode},
    )


def _wake(deployment: Deployment, actor: str) -> Deployment:
    host = deployment.host
    instance = _live_instance(deployment)
    if host is None or instance is None:
        return _start(deployment, actor)
    started = time.monotonic()
    pools = snapshots.gpu_pools(host, list(instance.gpu_indices))
    claim = estimates.claim_per_gpu(deployment, snapshots.device_total(host))
    for _round in range(MAX_SWITCH_ROUNDS):
        victims = _admit_wake(deployment, host, pools, claim)
        if not victims:
            break
        for victim in victims:
            _evict(victim, actor, for_name=deployment.name)
    else:
        raise NoCapacityError(
            f"{deployment.name}: memory was not freed after {MAX_SWITCH_ROUNDS} rounds"
        )
    mode = deployment.parked_mode or RAM
    if not _transition(deployment.pk, [S.PARKED], S.WAKING):
        return _load(deployment.pk)
    driver = driver_for(host)
    key = instance_key(instance)
    try:
        driver.wake(key, mode, deployment.setting("wake_timeout_seconds"))
        usage = driver.usage(key)
    except EngineError as exc:
        fail(deployment, driver, instance, f"wake failed: {exc}", actor)
        raise EngineFailedError(f"{deployment.name}: wake failed: {exc}") from exc
    figures = snapshots.measured(host, pools, usage, claim)
    with host_lock(host.pk) as locked:
        _record_measured(locked, deployment, figures, "measured")
        _transition(deployment.pk, [S.WAKING], S.READY, parked_mode="", state_reason="")
    deployment.observed_state, deployment.parked_mode, deployment.state_reason = S.READY, "", ""
    record(
        deployment,
        "deployment.woke",
        f"woke {deployment.name} from {mode}",
        started=started,
        actor=actor,
        data={"mode": mode},
    )
    return deployment


def _admit_wake(
    deployment: Deployment, host: Host, pools: list[str], claim: int
) -> tuple[Victim, ...]:
    """Promise the claim back on the deployment's own GPUs, or name who must make room."""
    with host_lock(host.pk) as locked:
        entries = {
            e.pool: e for e in LedgerEntry.objects.filter(host=locked, deployment=deployment)
        }
        if any(e.status == LedgerEntry.Status.UNCONFIRMED for e in entries.values()):
            raise EngineFailedError(
                f"{deployment.name}: its parked memory is not confirmed released yet; "
                "waiting for the GPU probe to show it free"
            )
        residual = max((entries[p].bytes for p in pools if p in entries), default=0)
        usage = {u.pool: u for u in pool_usage(locked)}
        if all(usage[p].free_bytes + residual >= claim for p in pools if p in usage):
            # The fast path: it fits as it is, no need to look at who else is there.
            admit(locked, deployment.pk, dict.fromkeys(pools, claim), note="promised for a wake")
            return ()
        snap = snapshots.snapshot(locked)
        kept = (*pools, snap.ram_pool)
        others = HostSnapshot(
            snap.host_id,
            snap.name,
            snap.unified,
            {
                # Its own residual stays where it is: count only what it still lacks.
                p: Pool(p, snap.pools[p].capacity_bytes, snap.pools[p].used_bytes)
                for p in kept
                if p in snap.pools
            },
            [r for r in snap.residents if r.deployment_id != deployment.pk],
        )
        need = Need(deployment.pk, deployment.name, len(pools), claim - residual, 0, (host.pk,))
        result = plan([others], need)
        if isinstance(result, NoCapacity):
            raise NoCapacityError(result.reason, result.blockers)
        if not result.victims:
            admit(locked, deployment.pk, dict.fromkeys(pools, claim), note="promised for a wake")
            return ()
        for victim in result.victims:
            _transition(victim.deployment_id, [S.READY], S.DRAINING)
        return result.victims


def stop(deployment_id: int, actor: str = "system") -> Deployment:
    """The person's intent "stop it": desired stopped, engine ended, memory released."""
    Deployment.objects.filter(pk=deployment_id).update(desired_state="stopped")
    return _stop(_load(deployment_id), actor, reason="stopped on request")


def _stop(
    deployment: Deployment, actor: str, *, reason: str, level: str = Event.Level.INFO
) -> Deployment:
    started = time.monotonic()
    current = deployment.observed_state
    if current == S.STOPPED:
        return deployment
    if not _transition(deployment.pk, [current], S.STOPPING):
        return _load(deployment.pk)
    instance = _live_instance(deployment)
    if instance is not None and deployment.host is not None:
        driver_for(deployment.host).stop(instance_key(instance), STOP_GRACE_SECONDS)
        Instance.objects.filter(pk=instance.pk).update(
            state=Instance.State.EXITED, ended_at=timezone.now()
        )
    if deployment.host_id is not None:
        with host_lock(deployment.host_id) as locked:
            release(locked, deployment.pk)
    _transition(deployment.pk, [S.STOPPING], S.STOPPED, parked_mode="", state_reason=reason)
    record(
        deployment,
        "deployment.stopped",
        reason
        if reason.startswith(f"stopped {deployment.name}")
        else f"stopped {deployment.name}: {reason}",
        level=level,
        started=started,
        actor=actor,
    )
    return _load(deployment.pk)


def touch(deployment_id: int) -> None:
    """Note a request for the deployment (least-recently-used order), at most once a second."""
    now = timezone.now()
    Deployment.objects.filter(pk=deployment_id).exclude(
        last_request_at__gt=now - timedelta(seconds=1)
    ).update(last_request_at=now)


__all__ = [
    "DEEP",
    "RAM",
    "EngineFailedError",
    "ModelStoppedError",
    "NoCapacityError",
    "SchedulerError",
    "ensure_ready",
    "park",
    "start",
    "stop",
    "touch",
]
