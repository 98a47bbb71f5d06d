"""A host's engines, by instance id: what the control plane drives, in one process
(standalone's ``local`` host) or over mutual TLS through the host agent.

Everything it answers is plain data (:class:`Launched`, :class:`ProcessUsage`, numbers),
so the same calls work in-process and as JSON.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from hostagent.errors import AdapterError, EngineExitedError
from hostagent.kinds.adapters import check_adapter_name
from hostagent.probe import DEVICE, DeviceReading, Inventory, Probe, ProcessUsage, process_tree
from hostagent.runtime import DEFAULT_RELEASE_SECONDS, EngineRuntime, Instance, InstanceRequest
from hostagent.sources import FetchStatus, SourceCache, classify

logger = logging.getLogger("hostagent.host")


@dataclass(frozen=True)
class Launched:
    """A started engine, as the control plane records it."""

    pid: int
    port: int  # 0 where it listens on a Unix socket
    api_key: str
    log_path: str
    # What the engine program said of itself on this host (EngineFeatures.as_dict()).
    features: dict[str, Any] | None = None
    socket_path: str = ""  # its Unix socket on its host, where it listens on one

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class Ending:
    """An engine being stopped, with its processes as they were when its stop began."""

    instance: Instance
    processes: list[psutil.Process]

    def running(self) -> bool:
        return any(process.is_running() for process in self.processes)

    def usage(self, runtime: EngineRuntime) -> ProcessUsage | None:
        """What it still holds, read from each of its processes that still runs (its
        workers may outlive its leader); None once none runs. Where its share was measured
        by device, that share, while any of them runs."""
        alive = [process for process in self.processes if process.is_running()]
        if not alive:
            return None
        if self.instance.measured_by == DEVICE:
            return runtime.usage(self.instance)
        pids = {process.pid for process in alive}
        gpu: dict[int, int | None] = {}
        host_bytes = 0
        for process in alive:
            try:
                if process.ppid() in pids:
                    continue  # read with the process above it
            except psutil.Error:
                continue
            seen = runtime.probe.process_usage(process.pid)
            for index, used in seen.gpu.items():
                gpu[index] = (gpu.get(index) or 0) + (used or 0)
            host_bytes += seen.host_bytes
        return ProcessUsage(gpu=gpu, host_bytes=host_bytes)


class HostRuntime:
    """Engines as children of this process, through :class:`EngineRuntime`."""

    def __init__(
        self,
        probe: Probe,
        log_dir: Path,
        state_file: Path | None = None,
        models_dir: Path | None = None,
        release_timeout: float = DEFAULT_RELEASE_SECONDS,
    ) -> None:
        self.probe = probe
        self.runtime = EngineRuntime(probe, log_dir, release_timeout=release_timeout)
        self.sources = SourceCache(models_dir or log_dir.parent / "models")
        self.state_file = state_file
        self._instances: dict[str, Instance] = {}
        self._ending: dict[str, Ending] = {}  # stopped, not yet known to have exited
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()

    # -- the state file: what survives a restart of this process ---------------------------

    def _save(self) -> None:
        if self.state_file is None:
            return
        # One save at a time (each writes the same temporary file, then renames it), its
        # snapshot taken inside it, so the file left is the newest; the engines' own lock
        # is held only for the snapshot.
        with self._save_lock:
            with self._lock:
                records = [
                    {
                        "request": asdict(i.request),
                        "port": i.port,
                        "socket_path": str(i.socket_path or ""),
                        "api_key": i.api_key,
                        "pid": i.pid,
                        "create_time": _create_time(i.pid),
                        "parked_mode": i.parked_mode,
                        "measured_by": i.measured_by,
                        "device_held": {str(k): v for k, v in i.device_held.items()},
                    }
                    for i in self._instances.values()
                ]
            temporary = self.state_file.with_suffix(".tmp")
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # keys
            with os.fdopen(fd, "w") as handle:
                json.dump(records, handle)
            temporary.replace(self.state_file)

    def restore(self) -> list[str]:
        """Re-adopt the engines an earlier run left running; returns their ids. Records of
        engines that are gone are dropped."""
        if self.state_file is None or not self.state_file.exists():
            return []
        try:
            records = json.loads(self.state_file.read_text())
        except ValueError:
            logger.warning("%s is damaged; starting with no engines", self.state_file)
            records = []
        adopted = []
        for record in records:
            request = InstanceRequest.from_dict(record["request"])
            instance = self.runtime.adopt(
                request,
                port=int(record["port"]),
                api_key=str(record["api_key"]),
                pid=int(record["pid"]),
                create_time=float(record["create_time"]),
                socket_path=Path(record["socket_path"]) if record.get("socket_path") else None,
            )
            if instance is None:
                logger.warning("engine %s (pid %s) is gone", request.instance_id, record["pid"])
                continue
            instance.parked_mode = record.get("parked_mode")
            instance.measured_by = record.get("measured_by")
            instance.device_held = {
                int(k): None if v is None else int(v)
                for k, v in (record.get("device_held") or {}).items()
            }
            self.runtime.meter.adopt(instance.measured_by)
            with self._lock:
                self._instances[request.instance_id] = instance
            adopted.append(request.instance_id)
            logger.warning("re-adopted engine %s (pid %s)", request.instance_id, record["pid"])
        self._save()
        return adopted

    def instance_ids(self) -> list[str]:
        with self._lock:
            return list(self._instances)

    def inventory(self) -> Inventory:
        """The probe's inventory, with how this host measures its engines as they showed
        it (the probe's own listing says it until one has)."""
        inventory = self.probe.inventory()
        learned = self.runtime.meter.learned()
        if learned is None or inventory.unified or not inventory.gpus:
            return inventory
        return replace(inventory, measures=learned[0], measures_reason=learned[1])

    def devices(self) -> list[DeviceReading]:
        return self.probe.devices()

    def _get(self, instance_id: str) -> Instance:
        with self._lock:
            found = self._instances.get(instance_id)
        if found is None:
            raise EngineExitedError(
                f"engine instance {instance_id} is not running on this host", None, ""
            )
        return found

    def instance(self, instance_id: str) -> Instance | None:
        with self._lock:
            return self._instances.get(instance_id)

    def launch(self, request: InstanceRequest) -> Launched:
        instance = self.runtime.launch(request)
        with self._lock:
            self._instances[request.instance_id] = instance
        self._save()
        features = instance.spec.features
        return Launched(
            instance.pid,
            instance.port,
            instance.api_key,
            str(instance.process.log_path),
            features.as_dict() if features is not None else None,
            str(instance.socket_path or ""),
        )

    def wait_ready(self, instance_id: str, timeout: float) -> float:
        try:
            return self.runtime.wait_ready(self._get(instance_id), timeout)
        finally:
            self._save()  # how its start measured it, for a restart

    def park(self, instance_id: str, mode: str, timeout: float) -> ProcessUsage:
        try:
            return self.runtime.park(self._get(instance_id), mode, timeout)
        finally:
            self._save()

    def wake(self, instance_id: str, mode: str, timeout: float) -> float:
        try:
            return self.runtime.wake(self._get(instance_id), mode, timeout)
        finally:
            self._save()

    # -- LoRA adapters ------------------------------------------------------------------------

    def load_adapter(self, instance_id: str, name: str, source: str, timeout: float) -> float:
        """Load the adapter fetched on this host from ``source`` into the instance's engine
        as ``name``; return the seconds the load took. Only a source this host resolves
        itself is loaded (a finished fetch, or a local path that exists): never a path the
        caller names. One already loaded is success."""
        check_adapter_name(name)
        path = self.adapter_path(source)
        return self.runtime.load_adapter(self._get(instance_id), name, path, timeout)

    def unload_adapter(self, instance_id: str, name: str) -> None:
        """Unload the adapter ``name``; one not loaded is success."""
        check_adapter_name(name)
        self.runtime.unload_adapter(self._get(instance_id), name)

    def loaded_adapters(self, instance_id: str) -> list[str] | None:
        """The adapters the instance's engine has loaded (None: it cannot tell)."""
        return self.runtime.loaded_adapters(self._get(instance_id))

    def adapter_path(self, source: str) -> str:
        """Where an adapter's files are on this host, from its source; AdapterError in one
        line where it is not fetched here."""
        kind = classify(source)
        if kind == "local":
            job: FetchStatus | None = self.sources.start(source)  # checked on the spot
        elif kind in ("hf", "http"):
            job = self.sources.status(source)
        else:
            raise AdapterError(
                f"adapter source {source!r} is neither a local path nor an hf:// or "
                "http(s):// source"
            )
        if job is None or job.state != "done" or not job.path:
            why = f": {job.error}" if job is not None and job.error else ""
            state = (
                "is being fetched"
                if job is not None and job.state == "running"
                else ("is not fetched")
            )
            raise AdapterError(f"adapter source {source} {state} on this host{why}")
        return job.path

    def stop(self, instance_id: str, grace_seconds: float) -> int:
        with self._lock:
            instance = self._instances.pop(instance_id, None)
            if instance is None:
                return 0
            # Its memory is its own until its processes exit: its workers (which hold the
            # GPU memory) may outlive its leader by up to the grace, or get stuck.
            self._ending[instance_id] = Ending(instance, process_tree(instance.pid))
        try:
            return self.runtime.stop(instance, grace_seconds)
        finally:
            with self._lock:
                ending = self._ending.pop(instance_id, None)
                if ending is not None and ending.running():
                    self._ending[instance_id] = ending  # stuck: it still holds its memory
            self._save()

    def usage(self, instance_id: str) -> ProcessUsage:
        return self.runtime.usage(self._get(instance_id))

    def asleep(self, instance_id: str) -> bool | None:
        """Whether the engine says it is parked (None: unknown, or no such engine)."""
        instance = self.instance(instance_id)
        return None if instance is None else self.runtime.asleep(instance)

    def alive(self, instance_id: str) -> bool:
        instance = self.instance(instance_id)
        return instance is not None and instance.process.alive()

    def known(self, instance_id: str) -> bool:
        """Whether this host started the instance (and has not stopped it)."""
        return self.instance(instance_id) is not None

    def exit_report(self, instance_id: str) -> tuple[int | None, str]:
        """An ended instance's exit status and last log lines (``None``: unknown)."""
        instance = self.instance(instance_id)
        if instance is None:
            return None, ""
        return instance.process.exit_code(), instance.process.log_tail(5)

    def instances(self) -> list[Instance]:
        """Every engine this process started and has not stopped."""
        with self._lock:
            return list(self._instances.values())

    def foreign(self, unified: bool) -> dict[str, int]:
        """Memory used by processes this host did not start, per pool, from the probe.

        The devices are read between two readings of what each engine holds, and each
        engine counts with the larger of its two: one that grows (a wake) or is ending
        while the devices are read is never taken for someone else's (foreign memory can
        be under-counted for a moment, until the next reading, never made up). A GPU that
        a measured step holds (the device path: an engine's share is known only once its
        step ends) is left out: its last figure stands."""
        moving = self.runtime.meter.leases.busy()
        before = self._holdings()
        readings = self.devices()
        ram = None if unified else self.probe.ram()
        after = self._holdings()
        moving |= self.runtime.meter.leases.busy()
        ours: dict[int, int] = {}
        ram_ours = 0
        for instance_id in before.keys() | after.keys():
            first, second = before.get(instance_id), after.get(instance_id)
            gpus = {**(first.gpu if first else {}), **(second.gpu if second else {})}
            for index in gpus:
                used = max((u.gpu.get(index) or 0) for u in (first, second) if u is not None)
                ours[index] = ours.get(index, 0) + used
            ram_ours += max(u.host_bytes for u in (first, second) if u is not None)
        figures: dict[str, int] = {}
        for reading in readings:
            if reading.index in moving:
                continue
            pool = "unified" if unified else f"gpu{reading.index}"
            figures[pool] = max(reading.used_bytes - ours.get(reading.index, 0), 0)
        if ram is not None:
            total, available = ram
            figures["ram"] = max(total - available - ram_ours - _own_rss(), 0)
        return figures

    def _holdings(self) -> dict[str, ProcessUsage]:
        """What each engine this host started holds now, those being stopped included
        (until none of their processes runs)."""
        with self._lock:
            ending = dict(self._ending)
            running = dict(self._instances)
        held = {key: self.runtime.usage(instance) for key, instance in running.items()}
        for key, stopping in ending.items():
            usage = stopping.usage(self.runtime)
            if usage is None:
                with self._lock:
                    if self._ending.get(key) is stopping:
                        del self._ending[key]
            else:
                held[key] = usage
        return held

    def stop_all(self, grace_seconds: float = 10.0) -> None:
        """End every engine this process started (at shutdown)."""
        for instance_id in list(self._instances):
            self.stop(instance_id, grace_seconds)

    # -- model sources ------------------------------------------------------------------------

    def fetch_start(self, source: str) -> FetchStatus:
        """Begin (or join) fetching a model source on this host."""
        return self.sources.start(source)

    def fetch_status(self, source: str) -> FetchStatus | None:
        return self.sources.status(source)

    def downloads(self) -> list[dict[str, object]]:
        return self.sources.listing()

    def prune(self, keep: list[str], dry_run: bool) -> list[dict[str, object]]:
        return self.sources.prune_listing(keep, dry_run)


def _create_time(pid: int) -> float:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return 0.0


def _own_rss() -> int:
    """This process (CapyCTL or its agent) counts as ours, not as foreign."""
    try:
        return int(psutil.Process().memory_info().rss)
    except psutil.Error:
        return 0
