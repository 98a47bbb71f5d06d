"""Park: a ready model gives back its GPU memory, its engine kept asleep (weights in host
RAM, or dropped), so a wake brings it back in seconds.

:func:`park` is the person's intent; :func:`park_ready` the verb (an eviction, an idle
park, a park check); :func:`best_mode` which park a model takes where it is now.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from capyctl.deployments.models import Deployment, ObservedState
from capyctl.engines import services as engines
from capyctl.engines.models import Engine
from capyctl.events.models import Event
from capyctl.hosts.models import Host
from capyctl.ledger.pools import read_ledger
from capyctl.ledger.services import host_lock
from capyctl.scheduler import deployment_locks, estimates, snapshots, transitions
from capyctl.scheduler.actions import adapters
from capyctl.scheduler.actions.common import instance_key, live_instance, load
from capyctl.scheduler.actions.drain import drain
from capyctl.scheduler.actions.stop import drain_and_stop, end_engine_and_fail, stop_engine
from capyctl.scheduler.drivers import driver_for
from capyctl.scheduler.errors import EngineFailedError, SchedulerError
from capyctl.scheduler.policy import DEEP, RAM, STOP, park_mode
from hostagent.errors import CannotParkError, EngineError, MemoryNotReleasedError


def park(
    deployment_id: int, mode: str | None = None, *, actor: str = "system", reason: str = ""
) -> Deployment:
    """Give back the deployment's GPU memory in ``mode`` (None: the best mode it allows)."""
    deployment = load(deployment_id)
    if not park_ready(deployment, mode, actor=actor, reason=reason):
        current = load(deployment_id)
        raise SchedulerError(
            f"{current.name} is {current.observed_state}; only a ready model can be parked"
        )
    return load(deployment_id)


def park_ready(  # noqa: PLR0911, PLR0912, PLR0915 - one operation, read top to bottom
    deployment: Deployment,
    mode: str | None,
    *,
    actor: str,
    reason: str,
    checking_park: bool = False,
    current: bool = False,
) -> bool:
    """Park (or, where it cannot park, stop) a ready deployment. False: it was not ready
    when this call had it alone, and nothing was done. Under its operating lock:

    1. the mode: asked for, else the best it allows here (a stop where it cannot park);
    2. drain it (READY -> DRAINING; its requests in flight finish);
    3. under the host lock, PARKING, with the weights copy a ``ram`` park keeps promised
       in host RAM (``deep`` instead where the copy no longer fits);
    4. the engine's park; an engine that refuses is stopped instead where this park makes
       room, and one that fails is ended and the model failed;
    5. PARKED, with what the probe measured it still holds (its residual).

    A park the engine answers but whose memory the probe does not see freed within the
    runtime's bound goes one step further: the engine is marked, so its models are stopped
    rather than parked until a park of it frees memory again, and the model is stopped
    (an ended process's memory is surely back). ``checking_park``: this park is that check
    (:func:`capyctl.scheduler.actions.ready.check_park`), and a park that kept its memory
    leaves the model parked for the check to wake. ``current``: the caller read
    ``deployment`` under its operating lock, which it still holds (no need to read it
    again)."""
    with deployment_locks.operating(deployment.pk, deployment.name):
        if not current:
            deployment = load(deployment.pk)  # decide on the row as it is now
        host = deployment.host
        instance = live_instance(deployment)
        if host is None or instance is None or deployment.observed_state != ObservedState.READY:
            return False
        evicting = reason.startswith("to make room")
        if mode is None:
            mode, because = best_mode(deployment, host)
            if mode == STOP:
                return drain_and_stop(
                    deployment, actor, reason=f"{because} ({reason})" if reason else because,
                    level=Event.Level.INFO,
                )  # fmt: skip
        elif mode == DEEP and (refused := snapshots.deep_park_refused(deployment)):
            # Asked for by name: in RAM where it can, else stopped, saying why.
            if best_mode(deployment, host)[0] == RAM:
                mode, reason = (
                    RAM,
                    f"in RAM, not deep: {refused}" + (f" ({reason})" if reason else ""),
                )
            else:
                return drain_and_stop(
                    deployment, actor, reason=f"stopped instead of parking deep: {refused}",
                    level=Event.Level.WARNING,
                )  # fmt: skip
        started = time.monotonic()
        if not drain(deployment, "parking"):
            return False
        with host_lock(host) as locked:  # the host as read with its row, just now
            read = read_ledger(locked)  # its entries, and the pools' usage for a copy
            mine = read.entries(deployment.pk)
            engine_ram = mine.get("ram", 0)
            copy = None
            if mode == RAM and snapshots.ram_pool(host) == "ram":
                gpu_held = sum(b for p, b in mine.items() if p != "ram")
                copy = estimates.weights_bytes(deployment, gpu_held)
            parking = transitions.parking(locked, deployment, copy, read)
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
            drain_and_stop(
                deployment, actor, reason=f"{message} ({reason})", level=Event.Level.WARNING
            )
            return True
        except MemoryNotReleasedError as exc:
            transitions.parked(
                deployment, host, mode, None, reason=str(exc), started=started, actor=actor
            )
            engines.mark_park_unverified(deployment.engine_id, str(exc), actor=actor)
            if not checking_park:
                because = f"its {mode} park did not free its GPU memory"
                stop_engine(
                    load(deployment.pk), actor, level=Event.Level.WARNING,
                    reason=f"stopped {deployment.name} instead: {because}"
                    + (f" ({reason})" if reason else ""),
                )  # fmt: skip
            return True
        except EngineError as exc:
            end_engine_and_fail(deployment, driver, instance, f"park failed: {exc}", actor)
            raise EngineFailedError(f"{deployment.name}: park failed: {exc}") from exc
        pools = snapshots.gpu_pools(host, list(instance.gpu_indices))
        figures = snapshots.measured(host, pools, residual, 0)
        remembered: dict[str, Any] = {}
        left = snapshots.measured(host, pools, residual, -1)  # -1: not known on that GPU
        # What it leaves on a GPU, counted on when it is parked again: where it is known
        # and not nothing (a device-path figure may read 0 when the GPU fell by more than
        # its share); on unified memory a deep park's only (a ram park's copy stays in the
        # same pool).
        most = max((left[p] for p in pools), default=0)
        known = all(left[p] >= 0 for p in pools) and most > 0
        if known and (mode == DEEP or "unified" not in pools):
            remembered["measured_residual_bytes"] = most
        if mode == RAM and "ram" in figures and engine_ram and figures["ram"] > engine_ram:
            # The weights copy, measured: what host RAM grew by when the weights moved there.
            remembered["measured_weights_bytes"] = figures["ram"] - engine_ram
        transitions.parked(
            deployment, host, mode, figures, reason=reason, started=started, actor=actor,
            **remembered,
        )  # fmt: skip
        if mode == DEEP:  # its engine dropped what it held beside its weights
            adapters.forget(
                instance, f"{deployment.name} parked deep; it loads again when asked for"
            )
        # This park freed its memory: the engine is trusted again. Looked up only where it
        # was marked when its row was read (a mark set since is as one set after the look).
        marked = deployment.engine.park_unverified_at is not None
        if marked and engine_marked(deployment.engine_id):
            engines.clear_park_unverified(
                deployment.engine_id, f"a {mode} park of {deployment.name}", actor=actor
            )
        return True


def engine_marked(engine_id: int) -> bool:
    """Whether the engine is marked for parks that kept their memory."""
    return Engine.objects.filter(pk=engine_id, park_unverified_at__isnull=False).exists()


def best_mode(deployment: Deployment, host: Host, *, checking: bool = False) -> tuple[str, str]:
    """The mode a park of ``deployment`` takes here and, where that is a stop, why.
    ``checking``: as if its engine's parks were trusted (a park check)."""
    snap = snapshots.snapshot(host)
    resident = next((r for r in snap.residents if r.deployment_id == deployment.pk), None)
    if resident is None:
        return STOP, "its engine cannot park, so it was stopped"
    if checking:
        resident = dataclasses.replace(resident, parks_unverified=False)
    ram_free = snap.pools[snap.ram_pool].free_bytes if snap.ram_pool in snap.pools else 0
    mode, why = park_mode(resident, snap, ram_free)
    return mode, f"{why}, so it was stopped"
