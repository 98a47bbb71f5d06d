"""Start: a stopped (or failed) model placed on a host, its weights fetched there, its
engine launched and measured.

:func:`start_engine` is the verb; :func:`admit_start` the one step under the host lock
that plans and promises the memory (STOPPED -> STARTING with its ledger entries and its
instance row, or the victims to evict first).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from capyctl.deployments.models import Deployment, Instance, ObservedState
from capyctl.engines import services as engines
from capyctl.hosts.models import Host
from capyctl.ledger.pools import device_total
from capyctl.ledger.services import InsufficientMemoryError, host_lock
from capyctl.scheduler import estimates, request_classes, snapshots, transitions, turns
from capyctl.scheduler.actions import adapters
from capyctl.scheduler.actions.common import MAX_SWITCH_ROUNDS, STOP_GRACE_SECONDS, load
from capyctl.scheduler.actions.evict import make_room
from capyctl.scheduler.actions.stop import end_engine_and_fail
from capyctl.scheduler.drivers import HostDriver, driver_for
from capyctl.scheduler.errors import (
    EngineFailedError,
    NoCapacityError,
    SchedulerError,
    SourceError,
    UnavailableError,
    is_control_plane_error,
)
from capyctl.scheduler.fetching import SourceFailedError, fetch_source
from capyctl.scheduler.policy import NoCapacity, Placement, Victim, plan
from capyctl.scheduler.transitions import record
from hostagent.errors import EngineError
from hostagent.runtime import InstanceRequest
from hostagent.units import format_size

logger = logging.getLogger("capyctl.scheduler")


@dataclass(frozen=True)
class Admitted:
    """A start admitted: where, on which pools, and its instance row."""

    host: Host
    placement: Placement
    instance: Instance


def start_engine(deployment: Deployment, actor: str) -> Deployment:
    """Start a stopped, failed or downloading deployment (its flight held by the caller):

    1. where: its own host, else the first with room for it now (:func:`source_host`);
    2. its weights there (fetched once; a fetch that waits for room is kept a minute);
    3. admitted on that host (:func:`admit_start`: STARTING, memory promised), evicting
       the victims the plan names, at most :data:`MAX_SWITCH_ROUNDS` rounds;
    4. the engine launched with its claim, then waited for until it answers;
    5. measured against its claim (:func:`check_claim`), then READY with the figures held
       (:func:`transitions.ready`).

    A step that fails ends the engine it launched and fails the model with the reason.
    """
    started = time.monotonic()
    source = source_host(deployment)
    source_path = _source_path(deployment, source, actor)
    if source_path is None:  # stopped while it downloaded
        return load(deployment.pk)
    deployment = load(deployment.pk)
    try:
        placed = _place(deployment, actor, source)
    except Exception as exc:
        if isinstance(exc, NoCapacityError) and not exc.lasting:  # it tries again, with these
            _fetched[deployment.pk] = (source.pk, deployment.source, source_path, time.monotonic())
        _fetch_ended(deployment, exc, "after its download", actor)
        raise
    if placed is None:
        return load(deployment.pk)
    host, placement, instance = placed.host, placed.placement, placed.instance
    instance_id = instance.key
    deployment = load(deployment.pk)
    record(
        deployment, "deployment.starting", f"starting {deployment.name} on {host.name}", actor=actor
    )
    driver = driver_for(host)
    claim = estimates.claim_per_gpu(deployment, device_total(host))
    try:  # an engine that takes its adapters at launch only: fetched first, in their order
        launch_adapters = adapters.at_launch(
            deployment, driver, deployment.setting("start_timeout_seconds")
        )
    except Exception as exc:
        end_engine_and_fail(deployment, driver, instance, f"its adapters: {exc}", actor)
        raise
    request = InstanceRequest(
        instance_id=instance_id,
        kind=deployment.engine.kind,
        command=deployment.engine.command,
        source=source_path,
        served_name=deployment.served_name,
        extra_args=list(deployment.engine_args),
        gpu_indices=placement.gpu_indices if deployment.gpus else [],
        env=dict(deployment.engine.env),
        options=dict(deployment.engine.options),
        ram_park=snapshots.launch_keeps_ram_copy(deployment, host),
        memory_fraction=estimates.memory_fraction(deployment, device_total(host)),
        claim_bytes=claim if deployment.gpus else None,
        media_domains=list(deployment.media_domains),
        adapter_slots=deployment.adapter_slots,
        adapter_max_rank=deployment.adapter_max_rank,
        adapters=launch_adapters,
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
            return load(deployment.pk)
        adapters.launched_with(instance, launch_adapters)
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
    raised = check_claim(deployment, driver, instance, figures, pools, claim=claim, actor=actor)
    if not transitions.ready(
        deployment, host, figures, pools, started=started, actor=actor, raised_claim=raised
    ):
        # stopped or failed meanwhile: its entries are gone, so is the engine
        driver.stop(instance_id, STOP_GRACE_SECONDS)
    return load(deployment.pk)


def source_host(deployment: Deployment) -> Host:
    """Where the deployment will run: its own host, else the first with room for it now
    (its weights are fetched there, and it is placed there). A draining host takes
    nothing new: a deployment placed there goes elsewhere; one whose host a person chose
    cannot, and is refused."""
    own = deployment.host
    if own is not None and own.drain_started_at is None:
        return own
    if own is not None and not deployment.movable:
        raise NoCapacityError(
            f"{deployment.name} cannot start: its host {own.name} is draining (capyctl host "
            f"undrain {own.name}, or give {deployment.name} another host)",
            lasting=True,
        )
    hosts = list(Host.objects.filter(drain_started_at__isnull=True))
    others = snapshots.siblings(deployment)
    if others and deployment.spread == "hosts":  # hosts with fewer of its siblings first
        on = Counter(
            Deployment.objects.filter(pk__in=others, host__isnull=False).values_list(
                "host_id", flat=True
            )
        )
        hosts.sort(key=lambda h: on[h.pk])
    if not hosts:
        where = "every host is draining" if Host.objects.exists() else "there are no hosts"
        raise NoCapacityError(f"no host can run {deployment.name}: {where}", lasting=True)
    for host in hosts:
        with host_lock(host.pk) as locked:
            classes = request_classes.demand()
            result = plan([snapshots.snapshot(locked, classes=classes)],
                          snapshots.need(deployment, locked, classes))  # fmt: skip
        if not isinstance(result, NoCapacity):
            return host
    return hosts[0]


def fits_elsewhere(deployment: Deployment) -> bool:
    """Whether a host other than its own, and not draining, could take the deployment now
    (parking or stopping others as a start may)."""
    others = Host.objects.filter(drain_started_at__isnull=True)
    if deployment.host_id is not None:
        others = others.exclude(pk=deployment.host_id)
    for host in others:
        with host_lock(host.pk) as locked:
            classes = request_classes.demand()
            result = plan([snapshots.snapshot(locked, classes=classes)],
                          snapshots.need(deployment, locked, classes))  # fmt: skip
        if not isinstance(result, NoCapacity):
            return True
    return False


def _place(deployment: Deployment, actor: str, target: Host) -> Admitted | None:
    """Admit the start on ``target``, evicting victims until the need fits. ``None``:
    another caller started or stopped it meanwhile, and nothing was admitted."""
    key = f"{deployment.name}-{uuid.uuid4().hex[:8]}"
    for _round in range(MAX_SWITCH_ROUNDS):
        result = admit_start(deployment, target, key)
        if result is None or isinstance(result, Admitted):
            return result
        make_room(result, actor, for_name=deployment.name)
    raise NoCapacityError(
        f"{deployment.name}: memory was not freed after {MAX_SWITCH_ROUNDS} rounds",
        lasting=False,  # others took what was freed meanwhile: the next try plans again
    )


def admit_start(
    deployment: Deployment, host: Host, key: str
) -> Admitted | tuple[Victim, ...] | None:
    """One round of placing a start on ``host``, under its lock: admitted (STARTING,
    memory promised, the instance row made), or the victims to evict first. ``None``:
    another caller started or stopped it meanwhile, and nothing was admitted."""
    with host_lock(host.pk) as locked:
        classes = request_classes.demand()
        need = snapshots.need(deployment, locked, classes)
        result = plan([snapshots.snapshot(locked, classes=classes)], need)
        if isinstance(result, NoCapacity):
            raise turns.refused(deployment.pk, deployment.name, result,
                                priority=deployment.priority, host_id=locked.pk,
                                claim_bytes=need.claim_per_gpu_bytes)  # fmt: skip
        if result.victims:
            return result.victims
        pools = snapshots.gpu_pools(locked, result.gpu_indices)
        figures = dict.fromkeys(pools, need.claim_per_gpu_bytes)
        ram = snapshots.ram_pool(locked)
        figures[ram] = figures.get(ram, 0) + need.host_ram_bytes
        try:
            instance = transitions.starting(
                locked,
                deployment,
                figures,
                result.gpu_indices,
                key=key,
                claim_bytes=need.claim_per_gpu_bytes,
            )
        except InsufficientMemoryError as exc:
            raise NoCapacityError(f"{deployment.name}: {exc}", lasting=False) from exc
        if instance is None:
            return None
        return Admitted(locked, result, instance)


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


def check_claim(
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
    held = ", ".join(f"{format_size(num_bytes)} on {pool}" for pool, num_bytes in over.items())
    reason = (
        f"its engine holds {held}, more than its claim of {format_size(claim)} per GPU and "
        f"the tolerance of {format_size(estimates.over_claim_tolerance(claim))}, so it was "
        "stopped (cap the engine lower, raise --gpu-memory, or set over_claim to raise)"
    )
    end_engine_and_fail(deployment, driver, instance, reason, actor)
    raise EngineFailedError(f"{deployment.name}: {reason}")
