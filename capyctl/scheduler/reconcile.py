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
from datetime import datetime, timedelta

import psutil
from django.db.models import Q
from django.utils import timezone

from capyctl.deployments.models import Deployment, Instance, ObservedState
from capyctl.engines.services import postpone_park_check
from capyctl.events.models import Event
from capyctl.events.services import record_event
from capyctl.hosts.models import Host
from capyctl.hosts.services import note_measures
from capyctl.ledger.models import LedgerEntry
from capyctl.scheduler import (
    actions,
    deployment_locks,
    errors,
    requests_in_progress,
    snapshots,
    transitions,
    turns,
)
from capyctl.scheduler.drivers import HostDriver, driver_for
from hostagent.errors import EngineCallError
from hostagent.measure import RELEASED_SHARE

logger = logging.getLogger("capyctl.scheduler")
LIVE = list(transitions.LIVE)


def _end_orphan(instance: Instance) -> None:
    """End an engine process of an earlier run, if that pid is still that engine (its
    command line names its socket or port)."""
    where = instance.socket_path or (str(instance.port) if instance.port else "")
    if not instance.pid or not where:
        return
    try:
        proc = psutil.Process(instance.pid)
        cmdline = proc.cmdline()
    except psutil.Error:
        return
    if where not in cmdline:
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
    for deployment in Deployment.objects.filter(
        host=host, observed_state__in=[*LIVE, ObservedState.FAILED]
    ):
        for instance in deployment.instances.exclude(state=Instance.State.EXITED):
            _end_orphan(instance)
            transitions.instance_exited(instance.pk)
        if transitions.recovered(deployment, host, shutting_down=shutting_down):
            recovered += 1
    return recovered


# How long each passing state may last (its own timeout, plus this margin) before a
# reconcile treats the deployment as stuck.
STUCK_MARGIN_SECONDS = 30
_STUCK_LIMITS: dict[str, str | None] = {
    ObservedState.STARTING: "start_timeout_seconds",
    ObservedState.WAKING: "wake_timeout_seconds",
    ObservedState.DRAINING: "drain_timeout_seconds",
    ObservedState.PARKING: "drain_timeout_seconds",
    ObservedState.STOPPING: None,
}
_PARK_CALL_SECONDS = 600  # a park call's own limit (see actions.park)


# A passing state nobody drives any more (the process that drove it died: no lock here,
# no lease in Redis) is repaired once it is this old, not after its whole timeout.
ORPHAN_GRACE_SECONDS = 5.0


def _orphaned_for(deployment: Deployment, now: datetime) -> float | None:
    """Seconds in a passing state, if past the grace (whether anyone drives it is asked
    apart)."""
    if deployment.observed_state not in _STUCK_LIMITS or deployment.state_changed_at is None:
        return None
    held = (now - deployment.state_changed_at).total_seconds()
    return held if held >= ORPHAN_GRACE_SECONDS else None


def _stuck_for(deployment: Deployment, now: datetime) -> float | None:
    """Seconds past its limit a deployment has stayed in a passing state, else None."""
    if deployment.observed_state not in _STUCK_LIMITS or deployment.state_changed_at is None:
        return None
    setting = _STUCK_LIMITS[deployment.observed_state]
    limit = float(STUCK_MARGIN_SECONDS + (deployment.setting(setting) if setting else 60))
    if deployment.observed_state == ObservedState.PARKING:
        limit += _PARK_CALL_SECONDS
    waited = (now - deployment.state_changed_at).total_seconds()
    return waited if waited > limit else None


def reconcile(host_id: int) -> None:
    """One pass over a host: dead or stuck engines, unconfirmed and foreign memory, idle
    models."""
    host = Host.objects.get(pk=host_id)
    driver = driver_for(host)
    now = timezone.now()
    _update_foreign(host, driver)
    if host.is_local:  # a remote host's way comes with its inventory, polled
        note_measures(host, driver.inventory().as_dict(), store=True)
    _end_orphans(host, driver)
    _release_orphaned_downloads(host, now)
    deployments = Deployment.objects.filter(host=host, observed_state__in=LIVE).select_related(
        "engine", "host"
    )
    for deployment in deployments:
        stuck = _stuck_for(deployment, now)
        if stuck is not None and deployment_locks.flight_free(deployment.pk):
            _repair_stuck(deployment, driver, stuck)
            continue
        orphaned = _orphaned_for(deployment, now)
        if orphaned is not None and not deployment_locks.driven_anywhere(deployment.pk):
            _repair_stuck(deployment, driver, orphaned)
            continue
        instance = deployment.instances.exclude(state=Instance.State.EXITED).first()
        if instance is None:
            continue
        key = actions.instance_key(instance)
        if not driver.known(key):
            if not host.is_local and _should_run(deployment, instance):
                # An agent is the only owner of its host's engines: one it does not know
                # is gone (the machine or the agent restarted without it).
                reason = f"its engine is gone from host {host.name} (was the host restarted?)"
                actions.end_engine_and_fail(deployment, driver, instance, reason, "system")
            continue  # in-process: another worker of this installation owns it
        if not driver.alive(key):
            _engine_died(deployment, driver, instance)
            continue
        if deployment.observed_state == ObservedState.PARKED:
            _confirm_release(deployment, driver, key, host)
        if deployment.observed_state == ObservedState.READY and _parked_unasked(
            deployment, driver, instance, host
        ):
            continue
        idle = deployment.setting("idle_park_seconds")
        # Idle since its last request ended, or since it became what it is (a wake).
        last = max((t for t in (deployment.last_request_at, deployment.state_changed_at) if t),
                   default=None)  # fmt: skip
        if (
            idle > 0
            and deployment.observed_state == ObservedState.READY
            and not deployment.pinned
            and last is not None
            and now - last >= timedelta(seconds=idle)
            and requests_in_progress.count_or_none(deployment.pk)
            == 0  # it serves (or unknown): not idle
            and _replicas_idle(deployment, now, idle)
        ):
            try:
                actions.park(deployment.pk, actor="system", reason=f"after {idle}s idle")
            except errors.SchedulerError as exc:
                logger.warning("idle park of %s did not happen: %s", deployment.name, exc)
    _check_parks(host, now)


def _replicas_idle(deployment: Deployment, now: datetime, idle: int) -> bool:
    """Whether every other replica of the deployment is idle too (a deployment of one
    replica: yes). While some replica serves, the idle ones beyond those kept up are
    parked by the replicas' own pass (:mod:`capyctl.scheduler.replica_scaling`); once all
    are idle, the model parks as a whole."""
    first = deployment.replica_of_id or deployment.pk
    if deployment.replica_of_id is None and deployment.replicas <= 1:
        return True
    others = Deployment.objects.filter(
        Q(pk=first) | Q(replica_of_id=first), observed_state__in=LIVE
    ).exclude(pk=deployment.pk)
    for other in others:
        if other.observed_state == ObservedState.PARKED:
            continue
        if other.observed_state != ObservedState.READY:
            return False  # coming up or going down: not idle
        last = max((t for t in (other.last_request_at, other.state_changed_at) if t),
                   default=now)  # fmt: skip
        if (
            now - last < timedelta(seconds=idle)
            or requests_in_progress.count_or_none(other.pk) != 0
        ):
            return False
    return True


# How long a model of an engine whose parks kept their memory must have had no request
# before it is parked to check that engine again (and woken again right after).
PARK_CHECK_IDLE_SECONDS = 60


def _check_parks(host: Host, now: datetime) -> None:
    """At an idle moment, check one engine whose parks kept their memory, with a park of
    one of its ready models here: nobody waits for room on the host, and the model has had
    no request for :data:`PARK_CHECK_IDLE_SECONDS`."""
    due = Deployment.objects.filter(
        host=host,
        observed_state=ObservedState.READY,
        pinned=False,
        engine__park_unverified_at__isnull=False,
        engine__park_check_after__lte=now,
    ).select_related("engine")
    quiet = now - timedelta(seconds=PARK_CHECK_IDLE_SECONDS)
    for deployment in due:
        last = deployment.last_request_at or deployment.state_changed_at
        if last is None or last > quiet or requests_in_progress.count_or_none(deployment.pk) != 0:
            continue
        if turns.contenders(host.pk):
            return  # someone waits for room: not an idle moment
        postpone_park_check(deployment.engine_id)  # one check, even if this one fails
        try:
            actions.check_park(deployment.pk)
        except errors.SchedulerError as exc:
            logger.warning("the park check of %s did not happen: %s", deployment.name, exc)
        return


DOWNLOAD_WATCH_SECONDS = 120  # a download's asker writes its progress every 0.5 s


def _release_orphaned_downloads(host: Host, now: datetime) -> None:
    """A deployment left ``downloading`` by a process that ended (a killed worker or a
    restarted server) is failed, so it does not look busy forever; the next request or
    start fetches again (the host's cache keeps what was already downloaded)."""
    for deployment in Deployment.objects.filter(
        host=host, observed_state=ObservedState.DOWNLOADING
    ):
        seen = _parse_time((deployment.download or {}).get("updated_at"))
        seen = seen or deployment.state_changed_at
        if seen is None or (now - seen).total_seconds() < DOWNLOAD_WATCH_SECONDS:
            continue
        reason = (
            f"its download of {deployment.source} stopped being watched (the process that "
            "ran it ended); the next start fetches again"
        )
        transitions.download_abandoned(deployment, reason)


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _should_run(deployment: Deployment, instance: Instance) -> bool:
    """Whether an engine must exist now for this deployment (not mid-launch or mid-step)."""
    settled = (ObservedState.READY, ObservedState.DRAINING, ObservedState.PARKED)
    return deployment.observed_state in settled and instance.state == Instance.State.RUNNING


def _repair_stuck(deployment: Deployment, driver: HostDriver, stuck: float) -> None:
    """A passing state held past its timeout with no operation running on it here."""
    if deployment.observed_state == ObservedState.DRAINING:
        # A switch gave up on it (or its worker died): it is still a working model.
        if transitions.drain_abandoned(deployment):
            logger.info("%s was left draining for %.0fs; it is ready again", deployment.name, stuck)
        return
    # Claim it first, from exactly the state and moment this pass saw: if it moved on
    # meanwhile (the slow step finished, another pass repaired it), nothing is touched.
    # STOPPING keeps a new start from beginning until its memory is released.
    instance = deployment.instances.exclude(state=Instance.State.EXITED).first()
    if not transitions.stuck(deployment):
        return
    reason = f"it stayed {deployment.observed_state} for {stuck:.0f}s, past its timeout"
    if instance is not None:
        driver.stop(actions.instance_key(instance), 2.0)
        transitions.instance_exited(instance.pk)
    transitions.failed(deployment, reason, expected=[ObservedState.STOPPING])


def _update_foreign(host: Host, driver: HostDriver) -> None:
    """Count memory used by processes CapyCTL did not start, per pool, from the probe."""
    transitions.foreign_measured(host, driver.foreign(bool((host.inventory or {}).get("unified"))))


def _end_orphans(host: Host, driver: HostDriver) -> None:
    """Stop engines the host runs that no live instance row stands for (left by a crash
    between a launch and its record, or re-adopted by an agent after the model was ended).
    The driver is asked first: every launch has its row before it starts."""
    running = driver.instance_ids()
    if not running:
        return
    wanted = {
        actions.instance_key(i)
        for i in Instance.objects.filter(host=host).exclude(state=Instance.State.EXITED)
    }
    for ident in running:
        if ident not in wanted:
            driver.stop(ident, actions.STOP_GRACE_SECONDS)
            record_event(
                "engine.orphan_stopped",
                f"stopped engine {ident} on {host.name}: no model of this server owns it",
                subject=host.name,
                host_id=host.pk,
                level=Event.Level.WARNING,
            )


def _engine_died(deployment: Deployment, driver: HostDriver, instance: Instance) -> None:
    code, tail = driver.exit_report(actions.instance_key(instance))
    reason = f"its engine exited with status {code}" + (f"; last lines:\n{tail}" if tail else "")
    actions.end_engine_and_fail(deployment, driver, instance, reason, "system")


def _parked_unasked(
    deployment: Deployment, driver: HostDriver, instance: Instance, host: Host
) -> bool:
    """A ready model whose engine says it is parked was parked outside CapyCTL (an engine
    on loopback answers its sleep routes to any local user; see docs/security.md): it is
    counted as parked, with what it holds measured, and an event says so. Never while an
    operation drives it: a park of CapyCTL's sleeps the engine before its state says so."""
    if deployment_locks.driven_anywhere(deployment.pk):
        return False
    key = actions.instance_key(instance)
    try:
        if driver.asleep(key) is not True:
            return False
        usage = driver.usage(key)
    except EngineCallError as exc:  # an agent without the question, or one busy now
        logger.info("could not ask %s's engine whether it sleeps: %s", deployment.name, exc)
        return False
    pools = snapshots.gpu_pools(host, list(instance.gpu_indices))
    figures = snapshots.measured(host, pools, usage, 0) if usage.gpu_known else None
    said = "it is sleeping (is_sleeping: true)"
    return transitions.parked_unasked(deployment, host, figures, said=said)


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
        held_bytes = usage.gpu.get(index)
        if held_bytes is None or held_bytes > entry.bytes * RELEASED_SHARE:
            return  # still not free: keep counting it
        figures[entry.pool] = held_bytes
    transitions.release_confirmed(deployment, host, figures)
