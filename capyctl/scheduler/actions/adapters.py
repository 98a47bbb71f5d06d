"""Adapters: load one into its base's running engine, unload the least recently used one
to make room, and forget those an engine dropped. The one writer of
:class:`~capyctl.deployments.models.LoadedAdapter`.

A load runs while the request that asked for it is counted in flight on the base, so the
base cannot be parked under it (a park drains first); it therefore takes no operating
lock of the base (a park waiting for that request to end would wait for the load too),
only this module's lock per engine, so that loads and unloads of one engine run one at a
time in this process. Across processes (server mode) each step is one the engine takes
twice without harm: loading an adapter it holds, unloading one it does not.

:func:`load` is the verb:

1. the adapter is held by this engine already: done;
2. while the engine's slots are full, the least recently used adapter with no request in
   flight is unloaded (never one serving a request; while every one serves, the load
   waits for one to end, as long as a request may wait for its model, then the request
   is told to retry shortly);
3. its source is fetched on the base's host (a local path is there already);
4. the engine loads it; the row and an ``adapter.loaded`` event record it, with the time.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from django.db.models import F
from django.utils import timezone

from capyctl.deployments.models import Adapter, Deployment, Instance, LoadedAdapter, ObservedState
from capyctl.events.services import record_event
from capyctl.prepared import Prepared
from capyctl.scheduler import requests_in_progress, transitions
from capyctl.scheduler.drivers import HostDriver, driver_for
from capyctl.scheduler.errors import EngineFailedError, SchedulerError, SourceError
from hostagent.errors import AdapterError, EngineError
from hostagent.kinds import get_kind
from hostagent.units import format_size

logger = logging.getLogger("capyctl.scheduler")
FETCH_POLL_SECONDS = 0.1
SLOT_POLL_SECONDS = 0.02  # how often a load that waits for a free slot looks again

# What an engine process holds (read at each deep park: its SQL built once).
_LOADED = Prepared(
    lambda instance_id: LoadedAdapter.objects.filter(instance_id=instance_id).select_related(
        "adapter"
    ),
    arity=1,
)

_locks: dict[int, threading.Lock] = {}
_locks_guard = threading.Lock()


class AdapterNotInEngineError(SchedulerError):
    """The adapter waits for its base's restart (an engine that takes adapters at launch)."""

    code = "adapter_not_loaded"


class AdaptersBusyError(SchedulerError):
    """Every slot of the engine holds an adapter serving a request: retry shortly."""

    code = "adapter_slots_busy"


@dataclass
class Loaded:
    """What a load did: its seconds (0 when the engine held it already) and the adapters it
    unloaded to make room."""

    seconds: float = 0.0
    unloaded: list[str] = field(default_factory=list)
    slot: int | None = None  # its place in the launch's list (llama-server), if it has one

    def describe(self, name: str) -> str:
        """For ``x-capyctl-switch``: ``unloaded adapter a; loaded adapter b 52 ms``."""
        if not self.seconds:
            return ""
        steps = [f"unloaded adapter {gone}" for gone in self.unloaded]
        steps.append(f"loaded adapter {name} {self.seconds * 1000:.0f} ms")
        return "; ".join(steps)


def _lock(instance_id: int) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(instance_id, threading.Lock())


def load(deployment_id: int, adapter_id: int, timeout: float, *, actor: str = "gateway") -> Loaded:
    """Have the running engine of the deployment (the adapter's base, or a replica of it)
    hold the adapter; see the module's steps."""
    deployment = Deployment.objects.select_related("host").get(pk=deployment_id)
    instance = Instance.objects.filter(deployment_id=deployment_id, state="running").first()
    if instance is None or deployment.host is None:
        raise SchedulerError(f"{deployment.name} has no running engine to load an adapter into")
    adapter = Adapter.objects.get(pk=adapter_id)
    held_now = LoadedAdapter.objects.filter(adapter=adapter, instance=instance).first()
    if held_now is not None:  # held: no lock taken (a load may be waiting for a slot)
        return Loaded(slot=held_now.slot)
    with _lock(instance.pk):
        held_now = LoadedAdapter.objects.filter(adapter=adapter, instance=instance).first()
        if held_now is not None:  # loaded while this waited for the lock
            return Loaded(slot=held_now.slot)
        if not _loads_while_running(deployment):
            raise AdapterNotInEngineError(
                f"{adapter.name} is not in {deployment.name}'s engine yet: "
                f"{deployment.engine.kind} takes its adapters at launch, and {deployment.name} "
                "restarts with it once idle; retry shortly"
            )
        driver = driver_for(deployment.host)
        done = Loaded()
        slots = _slots(deployment)
        held = list(
            LoadedAdapter.objects.filter(instance=instance)
            .select_related("adapter")
            .order_by(F("last_used_at").asc(nulls_first=True), "loaded_at")
        )
        gives_up = time.monotonic() + timeout
        while len(held) >= slots:
            victim = next((r for r in held if not _busy(r.adapter_id)), None)
            if victim is None:  # every slot serves a request: wait for one to end
                if time.monotonic() >= gives_up:
                    raise AdaptersBusyError(
                        f"every adapter slot of {deployment.name} ({slots}) served a request "
                        f"for {timeout:.0f}s; {adapter.name} loads when one is free: retry "
                        "shortly"
                    )
                time.sleep(SLOT_POLL_SECONDS)
                continue
            _unload(driver, instance, victim, f"to make room for {adapter.name} (least "
                    "recently used, no request in flight)", actor)  # fmt: skip
            held.remove(victim)
            done.unloaded.append(victim.adapter.name)
        started = time.monotonic()
        _fetch(driver, deployment, adapter, timeout)
        try:
            seconds = driver.load_adapter(instance.key, adapter.name, adapter.source, timeout)
        except AdapterError as exc:
            record_event("adapter.failed", f"adapter {adapter.name} could not be loaded into "
                         f"{deployment.name}: {exc}", level="error", subject=adapter.name,
                         actor=actor)  # fmt: skip
            raise EngineFailedError(f"adapter {adapter.name}: {exc}") from exc
        done.seconds = max(seconds, 0.001)
        LoadedAdapter.objects.create(
            adapter=adapter, instance=instance, load_seconds=done.seconds,
            last_used_at=timezone.now(),
        )  # fmt: skip
        _measure_ram(driver, deployment, instance, f"after loading adapter {adapter.name}")
        record_event(
            "adapter.loaded",
            f"adapter {adapter.name} loaded into {deployment.name} in "
            f"{done.seconds * 1000:.0f} ms (asked for by a request; "
            f"{time.monotonic() - started:.2f}s with its fetch)",
            subject=adapter.name,
            actor=actor,
        )
        return done


def _measure_ram(driver: HostDriver, deployment: Deployment, instance: Instance, note: str) -> None:
    """Hold what the engine's processes take in host RAM now: an engine keeps the adapters
    it loaded there too (vLLM's CPU cache of ``--max-cpu-loras``, SGLang's loaded ones)."""
    if deployment.host is None or (deployment.host.inventory or {}).get("unified"):
        return  # on unified memory its RAM is its GPU pool's, counted there
    try:
        usage = driver.usage(instance.key)
    except EngineError as exc:  # the figure stays as last measured; the next step measures
        logger.warning("%s: could not measure its engine after %s: %s", deployment.name, note, exc)
        return
    transitions.engine_ram_measured(deployment, deployment.host, usage.host_bytes, note)


def _loads_while_running(deployment: Deployment) -> bool:
    engine = deployment.engine
    kind = get_kind(engine.kind)
    return kind.capabilities(engine.options, engine.features()).runtime_adapters


def at_launch(deployment: Deployment, driver: HostDriver, timeout: float) -> list[tuple[str, str]]:
    """The adapters an engine that takes them at launch only starts with (name, path on its
    host, in order: their places are the slots requests name them by), each fetched there
    first: the base's adapters, the oldest first, as many as it has slots. Empty for an
    engine that loads them while it runs."""
    first = Deployment.objects.get(pk=deployment.replica_of_id or deployment.pk)
    if first.adapter_slots <= 0 or _loads_while_running(deployment):
        return []
    chosen = list(
        Adapter.objects.filter(base=first).order_by("created_at", "pk")[: first.adapter_slots]
    )
    return [(a.name, _fetch(driver, deployment, a, timeout)) for a in chosen]


def launched_with(instance: Instance, adapters: list[tuple[str, str]]) -> None:
    """The engine was launched holding ``adapters`` (see :func:`at_launch`)."""
    by_name = dict(
        Adapter.objects.filter(name__in=[n for n, _ in adapters]).values_list("name", "pk")
    )
    LoadedAdapter.objects.bulk_create(
        [
            LoadedAdapter(
                adapter_id=by_name[name], instance=instance, slot=index, last_used_at=timezone.now()
            )
            for index, (name, _) in enumerate(adapters)
            if name in by_name
        ]
    )


def _slots(deployment: Deployment) -> int:
    """The adapters its engine holds at once (a replica: its deployment's setting)."""
    if deployment.replica_of_id is not None:
        return int(
            Deployment.objects.filter(pk=deployment.replica_of_id)
            .values_list("adapter_slots", flat=True)
            .get()
        )
    return int(deployment.adapter_slots)


def _busy(adapter_id: int) -> bool:
    """Whether a request of the adapter is in flight (counts that cannot be read: yes)."""
    count = requests_in_progress.count_or_none(Adapter.ref_of(adapter_id))
    return count is None or count > 0


def _fetch(driver: HostDriver, deployment: Deployment, adapter: Adapter, timeout: float) -> str:
    """Have the adapter's files on the base's host (a local path is there already); their
    path there."""
    status = driver.fetch_start(adapter.source)
    ends = time.monotonic() + timeout
    while status.state == "running":
        if time.monotonic() > ends:
            raise SourceError(f"adapter {adapter.name}: its fetch took longer than {timeout:.0f}s")
        time.sleep(FETCH_POLL_SECONDS)
        status = driver.fetch_status(adapter.source) or driver.fetch_start(adapter.source)
    if status.state == "failed":
        raise SourceError(f"adapter {adapter.name}: {status.error} (on host {deployment.host})")
    if status.size_bytes is not None and adapter.source_bytes != status.size_bytes:
        Adapter.objects.filter(pk=adapter.pk).update(source_bytes=status.size_bytes)
        if status.downloaded:
            record_event("adapter.downloaded", f"downloaded {adapter.source}: "
                         f"{format_size(status.size_bytes)}", subject=adapter.name)  # fmt: skip
    return status.path or adapter.source


def _unload(
    driver: HostDriver, instance: Instance, row: LoadedAdapter, reason: str, actor: str
) -> None:
    started = time.monotonic()
    try:
        driver.unload_adapter(instance.key, row.adapter.name)
    except AdapterError as exc:
        raise EngineFailedError(f"adapter {row.adapter.name} could not be unloaded: {exc}") from exc
    row.delete()
    record_event(
        "adapter.unloaded",
        f"adapter {row.adapter.name} unloaded from {instance.deployment.name} "
        f"in {(time.monotonic() - started) * 1000:.0f} ms: {reason}",
        subject=row.adapter.name,
        actor=actor,
    )


def unload(adapter_id: int, *, reason: str, actor: str = "system") -> list[str]:
    """Unload the adapter from every engine holding it; refused while a request of it is in
    flight. Returns the deployments (rows) it was unloaded from."""
    if _busy(adapter_id):
        raise SchedulerError("a request of it is in flight; try again when it ends")
    gone = []
    for row in LoadedAdapter.objects.filter(
        adapter_id=adapter_id, instance__state="running"
    ).select_related("adapter", "instance__deployment__host", "instance"):
        instance = row.instance
        host = instance.deployment.host
        if host is None:
            continue
        driver = driver_for(host)
        with _lock(instance.pk):
            _unload(driver, instance, row, reason, actor)
            _measure_ram(
                driver, instance.deployment, instance, f"after unloading {row.adapter.name}"
            )
        gone.append(instance.deployment.name)
    return gone


def forget(instance: Instance, reason: str) -> None:
    """The engine no longer holds its adapters (parked deep, or ended): its rows go, each
    with an ``adapter.unloaded`` event saying why; they load again when asked for."""
    for row in _LOADED(instance.pk):
        row.delete()
        record_event(
            "adapter.unloaded",
            f"adapter {row.adapter.name} unloaded from {instance.deployment.name}: {reason}",
            subject=row.adapter.name,
        )


def note_used(deployment_id: int, adapter_id: int) -> None:
    """Note a request of the adapter on the deployment's engine (least recently used
    order)."""
    LoadedAdapter.objects.filter(
        adapter_id=adapter_id, instance__deployment_id=deployment_id, instance__state="running"
    ).update(last_used_at=timezone.now())


def base_ready(deployment: Deployment) -> bool:
    return deployment.observed_state == ObservedState.READY
