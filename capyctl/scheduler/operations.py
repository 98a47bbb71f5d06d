"""The scheduler's verbs: ensure ready, start, wake, park, stop, evict.

Each is a plain function over ids, safe to call twice. They decide; they change nothing
themselves: every change of observed state and of the ledger is a transition in
:mod:`capyctl.scheduler.transitions` (a conditional update that says whether it won),
memory is admitted under the host lock by :mod:`capyctl.scheduler.admission`, and one
deployment's operations run one at a time in a process (:mod:`capyctl.scheduler.deployment_locks`).
A wake read top to bottom: :func:`ensure_ready` → :func:`_wake` → ``admission.admit_wake``
(PARKED → WAKING, the claim promised) → the engine's wake → ``transitions.woke`` (READY,
the measured figures held).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.utils import timezone

from capyctl.deployments.models import Deployment, Instance, ObservedState
from capyctl.engines import services as engines
from capyctl.engines.models import Engine
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.ledger.pools import device_total
from capyctl.ledger.services import host_lock
from capyctl.scheduler import (
    admission,
    deployment_locks,
    estimates,
    requests_in_progress,
    snapshots,
    transitions,
    turns,
)
from capyctl.scheduler.deployment_locks import flight_free
from capyctl.scheduler.drivers import HostDriver, driver_for
from capyctl.scheduler.errors import (
    EngineFailedError,
    ModelStoppedError,
    NoCapacityError,
    SchedulerError,
    SourceError,
    UnavailableError,
    WakeTimeoutError,
    is_control_plane_error,
)
from capyctl.scheduler.fetching import SourceFailedError, fetch_source
from capyctl.scheduler.policy import DEEP, RAM, STOP, Victim, park_mode
from capyctl.scheduler.transitions import record
from hostagent.errors import (
    CannotParkError,
    EngineError,
    EngineStuckError,
    MemoryNotReleasedError,
)
from hostagent.runtime import InstanceRequest
from hostagent.units import format_size

logger = logging.getLogger("capyctl.scheduler")

MAX_SWITCH_ROUNDS = 4
# While what is in the way of a start or wake will pass (a model inside its
# min_ready_seconds, one starting, waking or draining, memory not yet confirmed free), the
# request tries again this often, within its wake timeout.
ROOM_RETRY_SECONDS = 0.25
STOP_GRACE_SECONDS = 10.0


def _load(deployment_id: int) -> Deployment:
    try:
        return Deployment.objects.select_related("engine", "host").get(pk=deployment_id)
    except Deployment.DoesNotExist:
        raise SchedulerError(f"deployment {deployment_id} no longer exists") from None


def _live_instance(deployment: Deployment) -> Instance | None:
    return (
        Instance.objects.filter(deployment_id=deployment.pk)
        .exclude(state=Instance.State.EXITED)
        .only("pk", "pid", "port", "gpu_indices", "key", "claim_bytes", "state")
        .first()
    )


# --- making room ---------------------------------------------------------------------------


def _place(deployment: Deployment, actor: str, target: Host) -> admission.Admitted | None:
    """Admit the start on ``target``, evicting victims until the need fits. ``None``:
    another caller started or stopped it meanwhile, and nothing was admitted."""
    key = f"{deployment.name}-{uuid.uuid4().hex[:8]}"
    for _round in range(MAX_SWITCH_ROUNDS):
        result = admission.admit_start(deployment, target, key)
        if result is None or isinstance(result, admission.Admitted):
            return result
        for victim in result:
            _evict(victim, actor, for_name=deployment.name)
    raise NoCapacityError(
        f"{deployment.name}: memory was not freed after {MAX_SWITCH_ROUNDS} rounds",
        lasting=False,  # others took what was freed meanwhile: the next try plans again
    )


def _evict(victim: Victim, actor: str, *, for_name: str) -> None:
    """Park or stop one victim, draining it first; one no longer ready is left alone (the
    next round plans again on what it became)."""
    deployment = _load(victim.deployment_id)
    reason = f"to make room for {for_name}" + (", its turn over" if victim.turn_over else "")
    if deployment.observed_state == ObservedState.PARKED and victim.mode == STOP:
        # A parked copy in host RAM that another engine needs: no request is in flight on
        # a parked model, so there is nothing to drain.
        message = f"stopped {deployment.name} (parked): {victim.reason} ({for_name})"
        logger.info(message)
        _stop(deployment, actor, reason=message)
        return
    if deployment.observed_state != ObservedState.READY:
        return
    if victim.mode != STOP:
        _park(deployment, victim.mode, actor=actor, reason=reason)
        return
    level = Event.Level.WARNING if "copy" in victim.reason else Event.Level.INFO
    message = f"stopped {deployment.name} instead of parking: {victim.reason}"
    _drain_and_stop(deployment, actor, reason=f"{message} ({reason})", level=level)


def _drain_and_stop(deployment: Deployment, actor: str, *, reason: str, level: str) -> bool:
    """Drain a ready deployment, then stop it; False: it was no longer ready."""
    with deployment_locks.operating(deployment.pk, deployment.name):
        if not _drain(deployment, "stopping"):
            return False
        logger.log(logging.WARNING if level == Event.Level.WARNING else logging.INFO,
                   "%s: %s", deployment.name, reason)  # fmt: skip
        _stop(deployment, actor, reason=reason, level=level)
        return True


def _drain(deployment: Deployment, doing: str) -> bool:
    """READY -> DRAINING, then wait for its requests in flight; on a timeout it goes back
    to READY and this raises (CapyCTL never cuts a request short to make room). False: it
    was not ready when asked (another caller drains, parks or stops it), and nothing was
    closed."""
    if not transitions.draining(deployment.pk):
        return False
    drain = deployment.setting("drain_timeout_seconds")
    try:
        if requests_in_progress.wait_drained(deployment.pk, drain):
            return True
    except requests_in_progress.CountsUnknown as exc:  # never taken for zero: it stays ready
        message = (
            f"gave up {doing} {deployment.name}: its requests in flight cannot be counted ({exc})"
        )
        transitions.drain_abandoned(deployment, message, kind="deployment.drain_abandoned")
        raise requests_in_progress.CountsUnknown(message) from exc
    left = requests_in_progress.count_or_none(deployment.pk)
    message = (
        f"gave up {doing} {deployment.name}: "
        + (f"{left} request(s)" if left is not None else "request(s)")
        + f" still in flight after {drain}s"
    )
    transitions.drain_abandoned(deployment, message)
    raise SchedulerError(message)


# --- operations ----------------------------------------------------------------------------


def ensure_ready(
    deployment_id: int,
    actor: str = "system",
    timeout: float | None = None,
    wanted: Callable[[], bool] | None = None,
) -> Deployment:
    """Make the deployment ready (start it, or wake it), evicting others if needed.

    Any number of concurrent calls for one deployment cause one start or wake; the others
    wait for it and share its outcome. While what is in the way passes, it tries again;
    ``wanted`` says whether anyone still waits (the gateway's queue): once nobody does, it
    gives up before it moves anything (UnavailableError).
    """
    deployment = _load(deployment_id)
    if deployment.desired_state == "stopped":
        raise ModelStoppedError(f"{deployment.name} is stopped; start it first")
    if deployment.observed_state == ObservedState.READY:
        return deployment
    deadline = time.monotonic() + (timeout or deployment.setting("max_queue_seconds"))
    try:
        return _until_ready(deployment, actor, deadline, wanted)
    finally:
        turns.done(deployment_id)  # its wait for room, if it had one, is over


def _until_ready(
    deployment: Deployment, actor: str, deadline: float, wanted: Callable[[], bool] | None
) -> Deployment:
    deployment_id = deployment.pk
    flight = deployment_locks.flight(deployment_id)
    first = True
    no_room: NoCapacityError | None = None  # the last try's: what is in the way will pass
    tries = 0  # tries in a row that found no room
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
        if observed == ObservedState.READY:
            return _load(deployment_id)
        if desired == "stopped":
            raise ModelStoppedError(f"{deployment.name} was stopped meanwhile")
        if flight.acquire(timeout=0.05):
            try:
                deployment, no_room = _try_once(deployment, actor)
                tries = tries + 1 if no_room is not None else 0
                if deployment.observed_state == ObservedState.READY:
                    return deployment
                # Told once the wait lasts past its first try again: a first refusal often
                # passes a moment later (the holder's last request had just ended), and
                # "waits for room" beside the park that came at once promised a wait that
                # never happened.
                if tries == 2:
                    record(deployment, "deployment.waiting", f"{no_room}", actor=actor)
            finally:
                flight.release()
        if time.monotonic() >= deadline:
            if no_room is not None:
                raise WakeTimeoutError(str(no_room))  # what it waited for, to its end
            raise SchedulerError(
                f"{deployment.name} is still {deployment.observed_state} after waiting"
            )
        # The first try again comes as soon as a model that was busy a moment ago (its
        # last request just ended) may give way; later ones every quarter second.
        retry = ROOM_RETRY_SECONDS if tries > 1 else snapshots.BUSY_GRACE_SECONDS
        time.sleep(0.05 if no_room is None else retry)
        if no_room is not None and wanted is not None and not wanted():
            raise UnavailableError(f"{deployment.name}: nobody waits for it any more")


def _try_once(deployment: Deployment, actor: str) -> tuple[Deployment, NoCapacityError | None]:
    """Under the deployment's flight: act on its state as it is now. The refusal for want
    of room is returned when what is in the way will pass (the caller tries again), and
    raised when it will not."""
    current = (
        Deployment.objects.filter(pk=deployment.pk)
        .values_list("observed_state", "parked_mode")
        .first()
    )
    if current is None:
        raise SchedulerError(f"deployment {deployment.pk} no longer exists")
    if current != (deployment.observed_state, deployment.parked_mode):
        deployment = _load(deployment.pk)
    try:
        return _act(deployment, actor), None
    except NoCapacityError as exc:
        if exc.lasting:  # waiting cannot help: refused at once
            raise
        return _load(deployment.pk), exc


def _act(deployment: Deployment, actor: str) -> Deployment:
    """Start a stopped or failed deployment, wake a parked one; others are left alone."""
    if deployment.observed_state in (
        ObservedState.STOPPED,
        ObservedState.FAILED,
        ObservedState.DOWNLOADING,
    ):
        # DOWNLOADING: join the fetch on its host (one per source there), or pick up one
        # whose asker is gone (a restart); only one caller gets to place it.
        return _start(deployment, actor)
    if deployment.observed_state == ObservedState.PARKED:
        return _wake(deployment, actor)
    return deployment


def start(deployment_id: int, actor: str = "system") -> Deployment:
    """The person's intent "run it": desired running, then ready."""
    transitions.desired(deployment_id, "running")
    return ensure_ready(deployment_id, actor)


# Weights fetched for a start that then had to wait for room, by deployment: (host,
# source, path, when). Its next try, within a minute, places it without fetching again (a
# fetch of a Hub or URL source asks the network each time).
_fetched: dict[int, tuple[int, str, str, float]] = {}
_FETCHED_FOR_SECONDS = 60.0


def _source_path(deployment: Deployment, source_host: Host, actor: str) -> str | None:
    """The path of its weights on ``source_host``: fetched there, or as fetched for its
    last try within a minute. ``None``: it was stopped while it downloaded."""
    memo = _fetched.pop(deployment.pk, None)
    try:
        if (
            memo is not None
            and memo[:2] == (source_host.pk, deployment.source)
            and time.monotonic() - memo[3] < _FETCHED_FOR_SECONDS
        ):
            return memo[2]
        return fetch_source(deployment, source_host, actor)
    except SourceFailedError as exc:
        transitions.failed(
            deployment,
            str(exc),
            actor=actor,
            expected=[ObservedState.STOPPED, ObservedState.FAILED, ObservedState.DOWNLOADING],
            code=SourceError.code,
        )
        raise SourceError(f"{deployment.name}: {exc}") from exc
    except Exception as exc:
        _fetch_ended(deployment, exc, "while fetching its weights", actor)
        raise


def _start(deployment: Deployment, actor: str) -> Deployment:
    started = time.monotonic()
    source_host = admission.source_host(deployment)
    source_path = _source_path(deployment, source_host, actor)
    if source_path is None:  # stopped while it downloaded
        return _load(deployment.pk)
    deployment = _load(deployment.pk)
    try:
        placed = _place(deployment, actor, source_host)
    except Exception as exc:
        if isinstance(exc, NoCapacityError) and not exc.lasting:  # it tries again, with these
            fetched = (source_host.pk, deployment.source, source_path, time.monotonic())
            _fetched[deployment.pk] = fetched
        _fetch_ended(deployment, exc, "after its download", actor)
        raise
    if placed is None:
        return _load(deployment.pk)
    host, placement, instance = placed.host, placed.placement, placed.instance
    instance_id = instance.key
    deployment = _load(deployment.pk)
    record(
        deployment, "deployment.starting", f"starting {deployment.name} on {host.name}", actor=actor
    )
    driver = driver_for(host)
    claim = estimates.claim_per_gpu(deployment, device_total(host))
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
        memory_fraction=estimates.memory_fraction(deployment, device_total(host)),
        claim_bytes=claim if deployment.gpus else None,
        media_domains=list(deployment.media_domains),
    )
    try:
        launched = driver.launch(request)
        engines.record_features(deployment.engine_id, launched.features, host.name, actor=actor)
        if not transitions.launched(
            instance,
            pid=launched.pid,
            port=launched.port,
            socket_path=launched.socket_path,
            api_key=launched.api_key,
            log_path=launched.log_path,
        ):  # stopped while it launched: end what was launched
            driver.stop(instance_id, STOP_GRACE_SECONDS)
            return _load(deployment.pk)
        driver.wait_ready(instance_id, deployment.setting("start_timeout_seconds"))
        usage = driver.usage(instance_id)
    except EngineError as exc:
        end_engine_and_fail(
            deployment, driver, instance, f"the engine failed to start: {exc}", actor
        )
        raise EngineFailedError(f"{deployment.name}: the engine failed to start: {exc}") from exc
    except Exception as exc:
        end_engine_and_fail(
            deployment, driver, instance, f"the start failed: {type(exc).__name__}: {exc}", actor
        )
        raise
    pools = snapshots.gpu_pools(host, placement.gpu_indices)
    figures = snapshots.measured(host, pools, usage, claim)
    raised = _check_claim(deployment, driver, instance, figures, pools, claim=claim, actor=actor)
    if not transitions.ready(
        deployment, host, figures, pools, started=started, actor=actor, raised_claim=raised
    ):
        # stopped or failed meanwhile: its entries are gone, so is the engine
        driver.stop(instance_id, STOP_GRACE_SECONDS)
    return _load(deployment.pk)


def _fetch_ended(deployment: Deployment, exc: Exception, when: str, actor: str) -> None:
    """A start that fetched (or was fetching) its weights could not go on: if it left the
    deployment ``downloading``, that ends now with what went wrong, not two minutes later
    with the reconcile's "stopped being watched". Room that will come (what is in the way
    passes): STOPPED, waiting for it, and the start tries again; a refusal that waiting
    cannot fix, or any other error: FAILED with it, told to whoever waits."""
    if isinstance(exc, SchedulerError):
        reason, code = str(exc), exc.code
    else:
        said = (str(exc).strip().splitlines() or [""])[0]  # PostgreSQL adds context lines
        reason = f"the start failed {when}: {type(exc).__name__}: {said}"
        code = UnavailableError.code
    try:
        if not Deployment.objects.filter(
            pk=deployment.pk, observed_state=ObservedState.DOWNLOADING
        ).exists():
            return  # a local source, or it moved on meanwhile
        if isinstance(exc, NoCapacityError) and not exc.lasting:
            transitions.fetched_waits_for_room(deployment, reason)
            return
        transitions.failed(
            deployment, reason, actor=actor, expected=[ObservedState.DOWNLOADING], code=code
        )
    except Exception as also:
        if not is_control_plane_error(also):
            raise
        # The database does not answer: the reconcile fails it once it does.
        logger.warning("%s: its start failed (%s) and the database did not take it (%s)",
                       deployment.name, reason, type(also).__name__)  # fmt: skip


def _check_claim(
    deployment: Deployment,
    driver: HostDriver,
    instance: Instance,
    figures: dict[str, int],
    pools: list[str],
    *,
    claim: int,
    actor: str,
) -> tuple[int, int] | None:
    """The start's measurement against its claim: within it (and its tolerance), None;
    past it, (claim, what to raise it to) where its ``over_claim`` is ``raise``, else its
    engine is stopped and the deployment failed with the figures (EngineFailedError)."""
    over = estimates.over_claim(figures, pools, claim)
    if not over:
        return None
    if deployment.over_claim == "raise":
        return claim, max(over.values())
    reason = _over_claim_reason(over, claim)
    end_engine_and_fail(deployment, driver, instance, reason, actor)
    raise EngineFailedError(f"{deployment.name}: {reason}")


def _over_claim_reason(over: dict[str, int], claim: int) -> str:
    """One line: where the engine holds more than its claim allows, and by how much."""
    held = ", ".join(f"{format_size(num_bytes)} on {pool}" for pool, num_bytes in over.items())
    return (
        f"its engine holds {held}, more than its claim of {format_size(claim)} per GPU and "
        f"the tolerance of {format_size(estimates.over_claim_tolerance(claim))}, so it was "
        "stopped (cap the engine lower, raise --gpu-memory, or set over_claim to raise)"
    )


def end_engine_and_fail(
    deployment: Deployment,
    driver: HostDriver,
    instance: Instance | None,
    reason: str,
    actor: str,
) -> None:
    """End the deployment's engine process, then fail the deployment: a step on a live
    engine went wrong, so the engine goes first. :func:`transitions.failed` then moves the
    state (its memory released with the process gone, or, if the process outlived SIGKILL,
    kept counted); a newer start or wake of it (an engine process other than ``instance``)
    is left alone. Where no engine needs ending, call :func:`transitions.failed` itself."""
    mine = instance.pk if instance is not None else None
    if instance is not None:
        try:
            driver.stop(instance_key(instance), 2.0)
        except EngineStuckError as exc:
            transitions.failed(deployment, f"{reason}; {exc}", actor=actor, engine_gone=False,
                               instance_id=mine)  # fmt: skip
            return
        transitions.instance_exited(instance.pk)
    transitions.failed(deployment, reason, actor=actor, instance_id=mine)


def instance_key(instance: Instance) -> str:
    """The host's name for an instance's engine process."""
    return instance.key


def park(
    deployment_id: int, mode: str | None = None, *, actor: str = "system", reason: str = ""
) -> Deployment:
    """Give back the deployment's GPU memory in ``mode`` (None: the best mode it allows)."""
    deployment = _load(deployment_id)
    if not _park(deployment, mode, actor=actor, reason=reason):
        current = _load(deployment_id)
        raise SchedulerError(
            f"{current.name} is {current.observed_state}; only a ready model can be parked"
        )
    return _load(deployment_id)


def _park(  # noqa: PLR0911 - one operation, read top to bottom
    deployment: Deployment,
    mode: str | None,
    *,
    actor: str,
    reason: str,
    checking_park: bool = False,
) -> bool:
    """Park (or, where it cannot park, stop) a ready deployment, draining it first. False:
    it was not ready when this call had it alone, and nothing was done.

    A park the engine answers but whose memory the probe does not see freed within the
    runtime's bound goes one step further: the model is stopped (an ended process's memory
    is surely back) and its engine is marked, so its models are stopped rather than parked
    until a park of it frees memory again. ``checking_park``: this park is that check
    (:func:`check_park`); a park that still keeps its memory is woken again instead of
    stopped."""
    with deployment_locks.operating(deployment.pk, deployment.name):
        deployment = _load(deployment.pk)  # decide on the row as it is now
        host = deployment.host
        instance = _live_instance(deployment)
        if host is None or instance is None or deployment.observed_state != ObservedState.READY:
            return False
        evicting = reason.startswith("to make room")
        if mode is None:
            mode, because = _best_mode(deployment, host)
            if mode == STOP:
                return _drain_and_stop(
                    deployment, actor, reason=f"{because} ({reason})" if reason else because,
                    level=Event.Level.INFO,
                )  # fmt: skip
        started = time.monotonic()
        mine = transitions.entries(host, deployment.pk)
        engine_ram = mine.get("ram", 0)
        copy = None
        if mode == RAM and snapshots.ram_pool(host) == "ram":
            gpu_held = sum(b for p, b in mine.items() if p != "ram")
            copy = estimates.weights_bytes(deployment, gpu_held)
        if not _drain(deployment, "parking"):
            return False
        with host_lock(host.pk) as locked:
            parking = transitions.parking(locked, deployment, copy)
        if parking is False:
            return False
        if parking is None:
            mode = DEEP  # its copy no longer fits in host RAM
        driver = driver_for(host)
        key = instance_key(instance)
        try:
            residual = driver.park(key, mode, deployment.setting("drain_timeout_seconds") + 600)
        except CannotParkError as exc:
            transitions.park_refused(deployment, host, engine_ram)
            if not evicting:
                raise SchedulerError(f"{deployment.name}: {exc}") from exc
            message = f"stopped {deployment.name} instead of parking: {exc}"
            _drain_and_stop(
                deployment, actor, reason=f"{message} ({reason})", level=Event.Level.WARNING
            )
            return True
        except MemoryNotReleasedError as exc:
            transitions.parked(
                deployment, host, mode, None, reason=str(exc), started=started, actor=actor
            )
            _kept_memory(
                deployment, mode, str(exc), actor=actor, reason=reason, checking_park=checking_park
            )
            return True
        except EngineError as exc:
            end_engine_and_fail(deployment, driver, instance, f"park failed: {exc}", actor)
            raise EngineFailedError(f"{deployment.name}: park failed: {exc}") from exc
        pools = snapshots.gpu_pools(host, list(instance.gpu_indices))
        figures = snapshots.measured(host, pools, residual, 0)
        remembered: dict[str, Any] = {}
        if mode == RAM and "ram" in figures and engine_ram and figures["ram"] > engine_ram:
            # The weights copy, measured: what host RAM grew by when the weights moved there.
            remembered["measured_weights_bytes"] = figures["ram"] - engine_ram
        transitions.parked(
            deployment, host, mode, figures, reason=reason, started=started, actor=actor,
            **remembered,
        )  # fmt: skip
        _engine_parks_trusted(deployment, mode, actor)
        return True


def _engine_parks_trusted(deployment: Deployment, mode: str, actor: str) -> None:
    """A park of ``deployment`` freed its memory: its engine, if marked, is trusted again."""
    if _engine_marked(deployment.engine_id):
        engines.clear_park_unverified(
            deployment.engine_id, f"a {mode} park of {deployment.name}", actor=actor
        )


def _engine_marked(engine_id: int) -> bool:
    return Engine.objects.filter(pk=engine_id, park_unverified_at__isnull=False).exists()


def _best_mode(deployment: Deployment, host: Host, *, checking: bool = False) -> tuple[str, str]:
    """The mode a park of ``deployment`` takes here and, where that is a stop, why.
    ``checking``: as if its engine's parks were trusted (:func:`check_park`)."""
    snap = snapshots.snapshot(host)
    resident = next((r for r in snap.residents if r.deployment_id == deployment.pk), None)
    if resident is None:
        return STOP, "its engine cannot park, so it was stopped"
    if checking:
        resident = dataclasses.replace(resident, parks_unverified=False)
    ram_free = snap.pools[snap.ram_pool].free_bytes if snap.ram_pool in snap.pools else 0
    mode, why = park_mode(resident, snap, ram_free)
    return mode, f"{why}, so it was stopped"


def _kept_memory(
    deployment: Deployment, mode: str, found: str, *, actor: str, reason: str, checking_park: bool
) -> None:
    """After a park that left its memory held (``found``, the probe's figures): the engine
    is marked, and the model stopped (or, in a check, woken again)."""
    engines.mark_park_unverified(deployment.engine_id, found, actor=actor)
    if checking_park:  # back as it was: its memory never left
        _wake(_load(deployment.pk), actor)
        return
    because = f"its {mode} park did not free its GPU memory"
    _stop(
        _load(deployment.pk), actor, level=Event.Level.WARNING,
        reason=f"stopped {deployment.name} instead: {because}" + (f" ({reason})" if reason else ""),
    )  # fmt: skip


def check_park(deployment_id: int, actor: str = "system") -> bool:
    """Park a ready model of an engine marked for parks that kept their memory, to see
    whether they free it now, and wake it again: the model is left as it was found. True:
    the park freed its memory, and the engine's models park again."""
    deployment = _load(deployment_id)
    host = deployment.host
    if host is None or deployment.observed_state != ObservedState.READY:
        return False
    mode, _ = _best_mode(deployment, host, checking=True)
    if mode == STOP:
        return False
    reason = f"to test whether engine {deployment.engine.name}'s parks free memory again"
    if not _park(deployment, mode, actor=actor, reason=reason, checking_park=True):
        return False
    freed = not _engine_marked(deployment.engine_id)
    if freed:
        ensure_ready(deployment_id, actor)
    return freed


def _wake(deployment: Deployment, actor: str) -> Deployment:
    host = deployment.host
    instance = _live_instance(deployment)
    if host is None or instance is None:
        return _start(deployment, actor)
    started = time.monotonic()
    pools = snapshots.gpu_pools(host, list(instance.gpu_indices))
    # What its engine was launched with, not today's setting: a sleeping engine wakes to
    # the memory it was started to use (a changed claim applies from its next start).
    claim = instance.claim_bytes
    if claim is None:
        claim = estimates.claim_per_gpu(deployment, device_total(host))
    for _round in range(MAX_SWITCH_ROUNDS):
        victims = admission.admit_wake(deployment, host, pools, claim)
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
        end_engine_and_fail(deployment, driver, instance, f"wake failed: {exc}", actor)
        raise EngineFailedError(f"{deployment.name}: wake failed: {exc}") from exc
    except Exception as exc:
        end_engine_and_fail(
            deployment, driver, instance, f"wake failed: {type(exc).__name__}: {exc}", actor
        )
        raise
    figures = snapshots.measured(host, pools, usage, claim)
    transitions.woke(deployment, host, figures, mode, started=started, actor=actor)
    return _load(deployment.pk)


def stop(deployment_id: int, actor: str = "system") -> Deployment:
    """The person's intent "stop it": desired stopped, engine ended, memory released."""
    transitions.desired(deployment_id, "stopped")
    deployment = _load(deployment_id)
    # A download holds its start's lock for as long as it takes: the stop does not wait.
    if deployment.observed_state == ObservedState.DOWNLOADING and transitions.download_stopped(
        deployment, actor=actor
    ):
        return _load(deployment_id)
    return _stop(deployment, actor, reason="stopped on request")


def _stop(
    deployment: Deployment, actor: str, *, reason: str, level: str = Event.Level.INFO
) -> Deployment:
    with deployment_locks.operating(deployment.pk, deployment.name):
        started = time.monotonic()
        for _attempt in range(5):
            current = (
                Deployment.objects.filter(pk=deployment.pk)
                .values_list("observed_state", flat=True)
                .first()
            )
            if current is None:
                raise SchedulerError(f"deployment {deployment.pk} no longer exists")
            if current == ObservedState.STOPPED:
                return _load(deployment.pk)
            if transitions.stopping(deployment.pk, current):
                break
        else:
            raise SchedulerError(f"could not stop {deployment.name}: its state kept changing")
        deployment = _load(deployment.pk)
        instance = _live_instance(deployment)
        if instance is not None and deployment.host is not None:
            try:
                driver_for(deployment.host).stop(instance_key(instance), STOP_GRACE_SECONDS)
            except EngineStuckError as exc:
                transitions.failed(
                    deployment,
                    str(exc),
                    actor=actor,
                    expected=[ObservedState.STOPPING],
                    engine_gone=False,
                )
                raise EngineFailedError(f"{deployment.name}: {exc}") from exc
            transitions.instance_exited(instance.pk)
        transitions.stopped(deployment, reason=reason, level=level, started=started, actor=actor)
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
    "SourceError",
    "end_engine_and_fail",
    "ensure_ready",
    "flight_free",
    "instance_key",
    "park",
    "record",
    "start",
    "stop",
    "touch",
]
