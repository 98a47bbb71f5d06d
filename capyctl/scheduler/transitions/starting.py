"""Transitions of a start: downloading, starting (memory promised), launched, ready (the
measured figures held), and a download's end and progress.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.utils import timezone

from capyctl.deployments.models import Deployment, Instance, ObservedState
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.ledger.services import (
    admit,
)
from capyctl.scheduler.transitions.base import logger, move, record, to_ready
from hostagent.units import format_size


def downloading(deployment: Deployment, host: Host) -> bool:
    """STOPPED/FAILED -> DOWNLOADING on ``host``, while it should run."""
    return move(
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
    if not move(
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
    # The host read again under the lock: a start's engine may have taken minutes to load.
    won = to_ready(deployment, host.pk, ObservedState.STARTING, figures, new_claim, **fields)
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


def download_stopped(deployment: Deployment, *, actor: str) -> bool:
    """DOWNLOADING -> STOPPED on request: nothing was admitted or launched yet. The fetch
    goes on into the host's cache (the next start takes it from there); the start that
    waited for it gives up within half a second."""
    reason = f"stopped on request while downloading {deployment.source}"
    if not move(
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
    return move(
        deployment.pk,
        [ObservedState.DOWNLOADING],
        ObservedState.STOPPED,
        parked_mode="",
        state_reason=reason,
    )


def download_progress(deployment: Deployment, data: Mapping[str, Any], line: str) -> bool:
    """While it downloads: the fetch's progress (``download``) and its line in
    ``state_reason``. False: it no longer downloads, and nothing changed."""
    rows = Deployment.objects.filter(pk=deployment.pk, observed_state=ObservedState.DOWNLOADING)
    return bool(rows.update(download=dict(data), state_reason=line))
