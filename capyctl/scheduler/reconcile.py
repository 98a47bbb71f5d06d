"""Keeping the ledger and the states true to what is really running.

``recover_local`` runs when standalone starts: engines of an earlier run are not this
process's children, so every deployment left in a live state is ended and counted as
stopped, and nothing stays ``waking`` or ``parking``. ``reconcile`` runs every few seconds:
dead engines become ``failed`` (their memory released, since their processes are gone),
memory left ``unconfirmed`` is released once the probe shows it free, idle models are
parked after ``idle_park_seconds``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from datetime import timedelta

import psutil
from django.utils import timezone

from capyctl.deployments.models import Deployment, Instance, ObservedState
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.services import host_lock, release, set_measured
from capyctl.scheduler import operations
from capyctl.scheduler.drivers import HostDriver, LocalHostDriver, driver_for
from hostagent.runtime import RELEASED_SHARE

logger = logging.getLogger("capyctl.scheduler")
S = ObservedState
LIVE = [S.STARTING, S.READY, S.DRAINING, S.PARKING, S.PARKED, S.WAKING, S.STOPPING]


def _end_orphan(instance: Instance) -> None:
    """End an engine process of an earlier run, if that pid is still that engine."""
    if not instance.pid or not instance.port:
        return
    try:
        proc = psutil.Process(instance.pid)
        cmdline = proc.cmdline()
    except psutil.Error:
        return
    if str(instance.port) not in cmdline:
        return  # the pid was reused by something else: leave it alone
    try:
        os.killpg(instance.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    with contextlib.suppress(psutil.Error):
        proc.wait(timeout=10)


def recover_local(host: Host, *, shutting_down: bool = False) -> int:
    """End what is left of engines not driven by this process, so states and the ledger
    are true: at start-up (an earlier run's) and at shutdown (after stopping ours)."""
    recovered = 0
    for deployment in Deployment.objects.filter(host=host, observed_state__in=[*LIVE, S.FAILED]):
        for instance in deployment.instances.exclude(state=Instance.State.EXITED):
            _end_orphan(instance)
            Instance.objects.filter(pk=instance.pk).update(
                state=Instance.State.EXITED, ended_at=timezone.now()
            )
        previous = deployment.observed_state
        with host_lock(host.pk) as locked:
            release(locked, deployment.pk)
        Deployment.objects.filter(pk=deployment.pk).update(
            observed_state=S.STOPPED,
            parked_mode="",
            state_changed_at=timezone.now(),
            state_reason=f"was {previous} when CapyCTL stopped; it starts again on demand",
        )
        if shutting_down:
            operations.record(
                deployment, "deployment.stopped", f"stopped {deployment.name}: CapyCTL stopped"
            )
        elif previous != S.FAILED:
            operations.record(
                deployment,
                "deployment.recovered",
                f"{deployment.name} was {previous} when CapyCTL last stopped; its engine was "
                "ended and it starts again on its next request",
            )
        recovered += 1
    return recovered


def reconcile(host_id: int) -> None:
    """One pass over a host: dead engines, unconfirmed memory, idle models."""
    host = Host.objects.get(pk=host_id)
    driver = driver_for(host)
    now = timezone.now()
    deployments = Deployment.objects.filter(host=host, observed_state__in=LIVE).select_related(
        "engine", "host"
    )
    for deployment in deployments:
        instance = deployment.instances.exclude(state=Instance.State.EXITED).first()
        if instance is None:
            continue
        key = operations.instance_key(instance)
        if isinstance(driver, LocalHostDriver) and driver.instance(key) is None:
            continue  # not started by this process (another worker owns it)
        if not driver.alive(key):
            _engine_died(deployment, driver, instance)
            continue
        if deployment.observed_state == S.PARKED:
            _confirm_release(deployment, driver, key, host)
        idle = deployment.setting("idle_park_seconds")
        last = deployment.last_request_at or deployment.state_changed_at
        if (
            idle > 0
            and deployment.observed_state == S.READY
            and not deployment.pinned
            and last is not None
            and now - last >= timedelta(seconds=idle)
        ):
            try:
                operations.park(deployment.pk, actor="system", reason=f"after {idle}s idle")
            except operations.SchedulerError as exc:
                logger.warning("idle park of %s did not happen: %s", deployment.name, exc)


def _engine_died(deployment: Deployment, driver: HostDriver, instance: Instance) -> None:
    found = driver.instance(operations.instance_key(instance))
    code = found.process.exit_code() if found else None
    tail = found.process.log_tail(5) if found else ""
    reason = f"its engine exited with status {code}" + (f"; last lines:\n{tail}" if tail else "")
    operations.fail(deployment, driver, instance, reason, "system")


def _confirm_release(deployment: Deployment, driver: HostDriver, key: str, host: Host) -> None:
    unconfirmed = list(
        LedgerEntry.objects.filter(
            deployment=deployment, status=LedgerEntry.Status.UNCONFIRMED
        ).exclude(pool="ram")
    )
    if not unconfirmed:
        return
    usage = driver.usage(key)
    figures = {}
    unified = bool((host.inventory or {}).get("unified"))
    for entry in unconfirmed:
        index = 0 if unified else int(entry.pool[3:])
        now_held = usage.gpu.get(index)
        if now_held is None or now_held > entry.bytes * RELEASED_SHARE:
            return  # still not free: keep counting it
        figures[entry.pool] = now_held
    with host_lock(host.pk) as locked:
        set_measured(locked, deployment.pk, figures)
        LedgerEntry.objects.filter(
            deployment=deployment, status=LedgerEntry.Status.UNCONFIRMED
        ).update(status=LedgerEntry.Status.HELD)
    Deployment.objects.filter(pk=deployment.pk).update(state_reason="")
    operations.record(
        deployment,
        "deployment.released",
        f"the GPU probe now shows {deployment.name}'s parked memory released",
        level=Event.Level.INFO,
    )
