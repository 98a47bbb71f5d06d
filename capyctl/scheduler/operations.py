"""The scheduler's operations: the only code that changes observed state and the ledger.

Each is a plain function over ids, safe to call twice. Observed state changes only by
conditional updates (``UPDATE … WHERE observed_state IN (expected)``), so two callers can
never both run the same transition: the one whose update matched does the work, the other
waits for its outcome. Memory is admitted in the ledger under the host lock before an
engine starts or wakes, and replaced by the probe's measured figures once it is ready.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

from django.utils import timezone

from capyctl.deployments.models import Deployment, Instance, ObservedState
from capyctl.errors import UserError
from capyctl.events.models import Event
from capyctl.events.services import record_event
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.pools import pool_usage
from capyctl.ledger.services import (
    InsufficientMemoryError,
    admit,
    host_lock,
    mark_unconfirmed,
    release,
    set_measured,
)
from capyctl.scheduler import estimates, inflight, snapshots
from capyctl.scheduler.drivers import HostDriver, driver_for
from capyctl.scheduler.fetching import SourceFailedError, fetch_source
from capyctl.scheduler.policy import (
    DEEP,
    RAM,
    STOP,
    HostSnapshot,
    Need,
    NoCapacity,
    Placement,
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


class SourceError(SchedulerError):
    """The deployment's weights are missing on its host, or their download failed."""

    code = "source_failed"


# --- state ------------------------------------------------------------------------------

# One re-entrant lock per deployment: a start, wake, park or stop of one deployment runs
# alone in this process (across processes, conditional transitions decide).
_flights: dict[int, threading.RLock] = {}
_flights_lock = threading.Lock()
OPERATION_LOCK_SECONDS = 3600.0


def _flight(deployment_id: int) -> threading.RLock:
    with _flights_lock:
        return _flights.setdefault(deployment_id, threading.RLock())


@contextlib.contextmanager
def _operating(deployment: Deployment) -> Iterator[None]:
    lock = _flight(deployment.pk)
    if not lock.acquire(timeout=OPERATION_LOCK_SECONDS):
        raise SchedulerError(f"{deployment.name}: another operation on it did not finish")
    try:
        yield
    finally:
        lock.release()


def flight_free(deployment_id: int) -> bool:
    """Whether no operation on the deployment is under way in this process."""
    flight = _flight(deployment_id)
    if flight.acquire(blocking=False):
        flight.release()
        return True
    return False


def transition_back_to_ready(deployment_id: int) -> bool:
    """DRAINING -> READY, for a drain that was abandoned."""
    return _transition(deployment_id, [S.DRAINING], S.READY)


def _transition(
    deployment_id: int,
    expected: Iterable[str],
    new: str,
    *,
    wanted: bool = False,
    **fields: object,
) -> bool:
    """Move to ``new`` only from one of ``expected`` (and, with ``wanted``, only while its
    desired state is running); return whether this call did it."""
    rows = Deployment.objects.filter(pk=deployment_id, observed_state__in=list(expected))
    if wanted:
        rows = rows.filter(desired_state="running")
    updated = rows.update(observed_state=new, state_changed_at=timezone.now(), **fields)
    if updated == 1 and new == S.READY:
        inflight.reopen(deployment_id)  # the drain gate, closed while it drained
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


def _source_host(deployment: Deployment) -> Host:
    """Where the deployment will run: its own host, else the first with room for it now
    (its weights are fetched there, and it is placed there)."""
    if deployment.host is not None:
        return deployment.host
    hosts = list(Host.objects.all())
    if not hosts:
        raise NoCapacityError(f"no host can run {deployment.name}: there are no hosts")
    for host in hosts:
        with host_lock(host.pk) as locked:
            result = plan([snapshots.snapshot(locked)], snapshots.need(deployment, locked))
        if not isinstance(result, NoCapacity):
            return host
    return hosts[0]


def _place(
    deployment: Deployment, actor: str, target: Host
) -> tuple[Host, Placement, Instance] | None:
    """Choose the pools on ``host``, evicting victims until the need fits; then, in one
    transaction under the host lock, claim the start (STOPPED/FAILED/DOWNLOADING ->
    STARTING), admit the memory and create the instance row. ``None``: another caller
    started or stopped it meanwhile, and nothing was admitted."""
    hosts: list[Host] = [target]
    for _round in range(MAX_SWITCH_ROUNDS):
        result: Placement | NoCapacity = NoCapacity(f"no host can run {deployment.name}")
        for host in hosts:
            with host_lock(host.pk) as locked:
                need = snapshots.need(deployment, locked)
                result = plan([snapshots.snapshot(locked)], need)
                if isinstance(result, NoCapacity):
                    continue
                if not result.victims:
                    if not _transition(
                        deployment.pk,
                        [S.STOPPED, S.FAILED, S.DOWNLOADING],
                        S.STARTING,
                        wanted=True,
                        host=locked,
                        state_reason="",
                    ):
                        return None
                    pools = snapshots.gpu_pools(locked, result.gpu_indices)
                    figures = dict.fromkeys(pools, need.claim_per_gpu_bytes)
                    ram = snapshots.ram_pool(locked)
                    figures[ram] = figures.get(ram, 0) + need.host_ram_bytes
                    try:
                        admit(locked, deployment.pk, figures, note="promised for a start")
                    except InsufficientMemoryError as exc:
                        raise NoCapacityError(f"{deployment.name}: {exc}") from exc
                    instance = Instance.objects.create(
                        deployment=deployment,
                        host=locked,
                        launch_key="",
                        gpu_indices=result.gpu_indices,
                        log_path=f"{deployment.name}-{uuid.uuid4().hex[:8]}",
                    )
                    return locked, result, instance
            break
        if isinstance(result, NoCapacity):
            raise NoCapacityError(result.reason, result.blockers)
        for victim in result.victims:
            _evict(victim, actor, for_name=deployment.name)
    raise NoCapacityError(
        f"{deployment.name}: memory was not freed after {MAX_SWITCH_ROUNDS} rounds"
    )


def _evict(victim: Victim, actor: str, *, for_name: str) -> None:
    """Park or stop one victim; one no longer ready is left alone (the next round
    re-plans)."""
    deployment = _load(victim.deployment_id)
    if deployment.observed_state not in (S.READY, S.DRAINING):
        return
    reason = f"to make room for {for_name}"
    if victim.mode != STOP:
        _park(deployment, victim.mode, actor=actor, reason=reason, fresh=True)
        return
    with _operating(deployment):
        if not _drain(deployment, "stopping"):
            return
        level = Event.Level.WARNING if "copy" in victim.reason else Event.Level.INFO
        message = f"stopped {deployment.name} instead of parking: {victim.reason}"
        logger.warning(message) if level == Event.Level.WARNING else logger.info(message)
        _stop(deployment, actor, reason=f"{message} ({reason})", level=level)


def _drain(deployment: Deployment, doing: str) -> bool:
    """READY -> DRAINING, then wait for its requests in flight; on a timeout it goes back
    to READY and this raises (CapyCTL never cuts a request short to make room)."""
    _transition(deployment.pk, [S.READY], S.DRAINING)
    inflight.close(deployment.pk)  # from here new requests wait for the next wake
    drain = deployment.setting("drain_timeout_seconds")
    if inflight.wait_drained(deployment.pk, drain):
        return True
    left = inflight.count(deployment.pk)
    _transition(deployment.pk, [S.DRAINING], S.READY)
    message = f"gave up {doing} {deployment.name}: {left} request(s) still in flight after {drain}s"
    record(deployment, "deployment.drain_timeout", message, level=Event.Level.WARNING)
    raise SchedulerError(message)


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
    first = True
    while True:
        observed, desired = (
            (deployment.observed_state, deployment.desired_state)
            if first
            else (
                Deployment.objects.filter(pk=deployment_id)
                .values_list("observed_state", "desired_state")
                .first()
            )
            or (None, None)
        )
        first = False
        if observed == S.READY:
            return _load(deployment_id)
        if desired == "stopped":
            raise ModelStoppedError(f"{deployment.name} was stopped meanwhile")
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
                deployment = _act(deployment, actor)
                if deployment.observed_state == S.READY:
                    return deployment
            finally:
                flight.release()
        if time.monotonic() >= deadline:
            raise SchedulerError(
                f"{deployment.name} is still {deployment.observed_state} after waiting"
            )
        time.sleep(0.05)


def _act(deployment: Deployment, actor: str) -> Deployment:
    """Start a stopped or failed deployment, wake a parked one; others are left alone."""
    if deployment.observed_state in (S.STOPPED, S.FAILED, S.DOWNLOADING):
        # DOWNLOADING: join the fetch on its host (one per source there), or pick up one
        # whose asker is gone (a restart); only one caller gets to place it.
        return _start(deployment, actor)
    if deployment.observed_state == S.PARKED:
        return _wake(deployment, actor)
    return deployment


def start(deployment_id: int, actor: str = "system") -> Deployment:
    """The person's intent "run it": desired running, then ready."""
    Deployment.objects.filter(pk=deployment_id).update(desired_state="running")
    return ensure_ready(deployment_id, actor)


def _start(deployment: Deployment, actor: str) -> Deployment:
    started = time.monotonic()
    source_host = _source_host(deployment)
    try:
        source_path = fetch_source(deployment, source_host, actor)
    except SourceFailedError as exc:
        _fail_source(deployment, str(exc), actor)
        raise SourceError(f"{deployment.name}: {exc}") from exc
    if source_path is None:  # stopped while it downloaded
        return _load(deployment.pk)
    deployment = _load(deployment.pk)
    placed = _place(deployment, actor, source_host)
    if placed is None:
        return _load(deployment.pk)
    host, placement, instance = placed
    instance_id = instance.log_path
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
        source=source_path,
        served_name=deployment.name,
        extra_args=list(deployment.engine_args),
        gpu_indices=placement.gpu_indices if deployment.gpus else [],
        env=dict(deployment.engine.env),
        options=dict(deployment.engine.options),
        ram_park=snapshots.launch_keeps_ram_copy(deployment, host),
        memory_fraction=estimates.memory_fraction(deployment, snapshots.device_total(host)),
    )
    try:
        launched = driver.launch(request)
        attached = Instance.objects.filter(pk=instance.pk, state=Instance.State.LAUNCHING).update(
            pid=launched.pid,
            port=launched.port,
            launch_key=launched.api_key,
            state=Instance.State.RUNNING,
            log_path=launched.log_path,
        )
        if not attached:  # stopped while it launched: end what was launched
            driver.stop(instance_id, STOP_GRACE_SECONDS)
            return _load(deployment.pk)
        driver.wait_ready(instance_id, deployment.setting("start_timeout_seconds"))
        usage = driver.usage(instance_id)
    except EngineError as exc:
        fail(deployment, driver, instance, f"the engine failed to start: {exc}", actor)
        raise EngineFailedError(f"{deployment.name}: the engine failed to start: {exc}") from exc
    except Exception as exc:
        fail(deployment, driver, instance, f"the start failed: {type(exc).__name__}: {exc}", actor)
        raise
    pools = snapshots.gpu_pools(host, placement.gpu_indices)
    figures = snapshots.measured(host, pools, usage, claim)
    with host_lock(host.pk) as locked:
        ready = _transition(
            deployment.pk,
            [S.STARTING],
            S.READY,
            measured_gpu_bytes=max((figures[p] for p in pools), default=None),
        )
        if ready:
            _record_measured(locked, deployment, figures, "measured")
    if not ready:  # stopped or failed meanwhile: its entries are gone, so is the engine
        driver.stop(instance_id, STOP_GRACE_SECONDS)
        return _load(deployment.pk)
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


def _fail_source(deployment: Deployment, reason: str, actor: str) -> None:
    """A source that is missing or failed to download: no engine ran, nothing was
    admitted; the deployment is failed with the reason."""
    _transition(
        deployment.pk,
        [S.STOPPED, S.FAILED, S.DOWNLOADING],
        S.FAILED,
        state_reason=reason[:2000],
        parked_mode="",
    )
    record(deployment, "deployment.failed", f"{deployment.name} failed: {reason}",
           level=Event.Level.ERROR, actor=actor)  # fmt: skip


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
        [s for s in S.values if s not in (S.FAILED, S.STOPPED, S.STOPPING)],
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


def _park(  # noqa: PLR0912, PLR0915 - one operation, read top to bottom
    deployment: Deployment, mode: str | None, *, actor: str, reason: str, fresh: bool = False
) -> None:
    with _operating(deployment):
        if not fresh:  # as it is now that this call has it alone
            deployment = _load(deployment.pk)
        host = deployment.host
        instance = _live_instance(deployment)
        parkable = (S.READY, S.DRAINING)
        if host is None or instance is None or deployment.observed_state not in parkable:
            raise SchedulerError(
                f"{deployment.name} is {deployment.observed_state}; only a ready model can be "
                "parked"
            )
        evicting = reason.startswith("to make room")
        if mode is None:
            snap = snapshots.snapshot(host)
            resident = next((r for r in snap.residents if r.deployment_id == deployment.pk), None)
            ram_free = snap.pools[snap.ram_pool].free_bytes if snap.ram_pool in snap.pools else 0
            mode = park_mode(resident, snap, ram_free)[0] if resident else STOP
            if mode == STOP:
                _stop(deployment, actor, reason="its engine cannot park, so it was stopped")
                return
        started = time.monotonic()
        _drain(deployment, "parking")
        with host_lock(host.pk) as locked:
            if not _transition(deployment.pk, [S.DRAINING], S.PARKING):
                return
            mine = dict(
                LedgerEntry.objects.filter(host=locked, deployment=deployment).values_list(
                    "pool", "bytes"
                )
            )
            engine_ram = mine.get("ram", 0)
            if mode == RAM and not _reserve_copy(deployment, locked, mine):
                mode = DEEP
        driver = driver_for(host)
        key = instance_key(instance)
        try:
            residual = driver.park(key, mode, deployment.setting("drain_timeout_seconds") + 600)
        except CannotParkError as exc:
            _transition(deployment.pk, [S.PARKING], S.READY)
            with host_lock(host.pk) as locked:
                set_measured(locked, deployment.pk, {"ram": engine_ram}, note="measured")
            if not evicting:
                raise SchedulerError(f"{deployment.name}: {exc}") from exc
            message = f"stopped {deployment.name} instead of parking: {exc}"
            logger.warning(message)
            _stop(deployment, actor, reason=f"{message} ({reason})", level=Event.Level.WARNING)
            return
        except MemoryNotReleasedError as exc:
            with host_lock(host.pk) as locked:
                if _transition(
                    deployment.pk, [S.PARKING], S.PARKED, parked_mode=mode, state_reason=str(exc)
                ):
                    mark_unconfirmed(locked, deployment.pk, "park answered, memory not seen free")
            record(
                deployment,
                "deployment.parked",
                f"{deployment.name} parked ({mode}) but its memory is not confirmed released: "
                f"{exc}",
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
        remembered: dict[str, Any] = {}
        if mode == RAM and "ram" in figures and engine_ram and figures["ram"] > engine_ram:
            # The weights copy, measured: what host RAM grew by when the weights moved there.
            remembered["measured_weights_bytes"] = figures["ram"] - engine_ram
        with host_lock(host.pk) as locked:
            if _transition(
                deployment.pk,
                [S.PARKING],
                S.PARKED,
                parked_mode=mode,
                state_reason=reason,
                **remembered,
            ):
                _record_measured(locked, deployment, figures, f"parked {mode}")
        record(
            deployment,
            "deployment.parked",
            f"parked {deployment.name} ({mode})" + (f" {reason}" if reason else ""),
            started=started,
            actor=actor,
            data={"mode": mode},
        )


def _reserve_copy(deployment: Deployment, host: Host, mine: dict[str, int]) -> bool:
    """Promise host RAM for a ``ram`` park's weights copy before making it; False (park
    deep instead) when host RAM cannot hold it now. Runs inside :func:`host_lock`;
    ``mine`` is the deployment's entries (pool -> bytes)."""
    if snapshots.ram_pool(host) != "ram":
        return True  # unified: the copy stays in the same pool
    claim = max((b for p, b in mine.items() if p != "ram"), default=0)
    copy = estimates.weights_bytes(deployment, claim)
    try:
        # admit() checks every pool before writing, so a refusal changes nothing.
        admit(
            host,
            deployment.pk,
            {"ram": mine.get("ram", 0) + copy},
            note="promised for a copy",
            held_now=mine,
        )
    except InsufficientMemoryError:
        record(
            deployment,
            "deployment.park_mode",
            f"parking {deployment.name} deep: its copy ({format_size(copy)}) no longer fits "
            "in host RAM",
        )
        return False
    return True


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
        if victims is None:
            return _load(deployment.pk)  # woken, or stopped, by someone else meanwhile
        if not victims:
            break
        for victim in victims:
            _evict(victim, actor, for_name=deployment.name)
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
        fail(deployment, driver, instance, f"wake failed: {exc}", actor)
        raise EngineFailedError(f"{deployment.name}: wake failed: {exc}") from exc
    except Exception as exc:
        fail(deployment, driver, instance, f"wake failed: {type(exc).__name__}: {exc}", actor)
        raise
    figures = snapshots.measured(host, pools, usage, claim)
    with host_lock(host.pk) as locked:
        woke = _transition(deployment.pk, [S.WAKING], S.READY, parked_mode="", state_reason="")
        if woke:
            _record_measured(locked, deployment, figures, "measured")
    if not woke:
        return _load(deployment.pk)
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
) -> tuple[Victim, ...] | None:
    """Under the host lock: if the claim fits back on its own GPUs, move PARKED -> WAKING
    and promise it (returns ``()``); else name who must make room. ``None``: it is no
    longer a parked model that should run (another caller woke or stopped it)."""
    with host_lock(host.pk) as locked:
        now = (
            Deployment.objects.filter(pk=deployment.pk)
            .values_list("observed_state", "desired_state")
            .first()
        )
        if now != (S.PARKED, "running"):
            return None
        # Its own entries (held residual, or unconfirmed: they still count the whole claim)
        # are replaced by the promise, so they count as room for it.
        mine = dict(
            LedgerEntry.objects.filter(host=locked, deployment=deployment).values_list(
                "pool", "bytes"
            )
        )
        usage = {u.pool: u for u in pool_usage(locked)}
        if all(usage[p].free_bytes + mine.get(p, 0) >= claim for p in pools if p in usage):
            _transition(deployment.pk, [S.PARKED], S.WAKING, wanted=True)
            try:
                admit(
                    locked,
                    deployment.pk,
                    dict.fromkeys(pools, claim),
                    note="promised",
                    held_now=mine,
                )
            except InsufficientMemoryError as exc:
                raise NoCapacityError(f"{deployment.name}: {exc}") from exc
            return ()
        snap = snapshots.snapshot(locked)
        residual = min((mine.get(p, 0) for p in pools), default=0)
        others = HostSnapshot(
            snap.host_id,
            snap.name,
            snap.unified,
            {p: snap.pools[p] for p in (*pools, snap.ram_pool) if p in snap.pools},
            [r for r in snap.residents if r.deployment_id != deployment.pk],
        )
        need = Need(deployment.pk, deployment.name, len(pools), claim - residual, 0, (host.pk,))
        result = plan([others], need)
        if isinstance(result, NoCapacity):
            raise NoCapacityError(result.reason, result.blockers)
        return result.victims or ()


def stop(deployment_id: int, actor: str = "system") -> Deployment:
    """The person's intent "stop it": desired stopped, engine ended, memory released."""
    Deployment.objects.filter(pk=deployment_id).update(desired_state="stopped")
    return _stop(_load(deployment_id), actor, reason="stopped on request")


def _stop(
    deployment: Deployment, actor: str, *, reason: str, level: str = Event.Level.INFO
) -> Deployment:
    with _operating(deployment):
        started = time.monotonic()
        for _attempt in range(5):
            current = (
                Deployment.objects.filter(pk=deployment.pk)
                .values_list("observed_state", flat=True)
                .first()
            )
            if current is None:
                raise SchedulerError(f"deployment {deployment.pk} no longer exists")
            if current == S.STOPPED:
                return _load(deployment.pk)
            if _transition(deployment.pk, [current], S.STOPPING):
                break
        else:
            raise SchedulerError(f"could not stop {deployment.name}: its state kept changing")
        deployment = _load(deployment.pk)
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
        message = (
            reason
            if reason.startswith(f"stopped {deployment.name}")
            else f"stopped {deployment.name}: {reason}"
        )
        record(deployment, "deployment.stopped", message, level=level, started=started, actor=actor)
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
