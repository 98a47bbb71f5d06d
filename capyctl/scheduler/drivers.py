"""How the scheduler reaches a host's engines: one interface, two transports.

``LocalHostDriver`` uses :mod:`hostagent` in this process (standalone's host ``local``);
the engines are this process's children. A remote host is driven over mutual TLS by the
host agent, which uses the same library.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Protocol

from django.conf import settings

from capyctl.errors import UserError
from capyctl.hosts.models import Host
from hostagent.errors import EngineExitedError
from hostagent.probe import DeviceReading, Inventory, Probe, ProcessUsage, make_probe
from hostagent.runtime import EngineRuntime, Instance, InstanceRequest


class HostDriver(Protocol):
    def inventory(self) -> Inventory: ...

    def devices(self) -> list[DeviceReading]: ...

    def launch(self, request: InstanceRequest) -> Instance: ...

    def wait_ready(self, instance_id: str, timeout: float) -> float: ...

    def park(self, instance_id: str, mode: str, timeout: float) -> ProcessUsage: ...

    def wake(self, instance_id: str, mode: str, timeout: float) -> float: ...

    def stop(self, instance_id: str, grace_seconds: float) -> int: ...

    def usage(self, instance_id: str) -> ProcessUsage: ...

    def alive(self, instance_id: str) -> bool: ...

    def instance(self, instance_id: str) -> Instance | None: ...


class LocalHostDriver:
    """Engines as children of this process, through :class:`EngineRuntime`."""

    def __init__(self, probe: Probe, log_dir: Path) -> None:
        self.probe = probe
        self.runtime = EngineRuntime(probe, log_dir)
        self._instances: dict[str, Instance] = {}
        self._lock = threading.Lock()

    def inventory(self) -> Inventory:
        return self.probe.inventory()

    def devices(self) -> list[DeviceReading]:
        return self.probe.devices()

    def _get(self, instance_id: str) -> Instance:
        with self._lock:
            found = self._instances.get(instance_id)
        if found is None:
            raise EngineExitedError(
                f"engine instance {instance_id} is not running in this process", None, ""
            )
        return found

    def instance(self, instance_id: str) -> Instance | None:
        with self._lock:
            return self._instances.get(instance_id)

    def launch(self, request: InstanceRequest) -> Instance:
        instance = self.runtime.launch(request)
        with self._lock:
            self._instances[request.instance_id] = instance
        return instance

    def wait_ready(self, instance_id: str, timeout: float) -> float:
        return self.runtime.wait_ready(self._get(instance_id), timeout)

    def park(self, instance_id: str, mode: str, timeout: float) -> ProcessUsage:
        return self.runtime.park(self._get(instance_id), mode, timeout)

    def wake(self, instance_id: str, mode: str, timeout: float) -> float:
        return self.runtime.wake(self._get(instance_id), mode, timeout)

    def stop(self, instance_id: str, grace_seconds: float) -> int:
        with self._lock:
            instance = self._instances.pop(instance_id, None)
        if instance is None:
            return 0
        return self.runtime.stop(instance, grace_seconds)

    def usage(self, instance_id: str) -> ProcessUsage:
        return self.runtime.usage(self._get(instance_id))

    def alive(self, instance_id: str) -> bool:
        instance = self.instance(instance_id)
        return instance is not None and instance.process.alive()

    def instances(self) -> list[Instance]:
        """Every engine this process started and has not stopped."""
        with self._lock:
            return list(self._instances.values())

    def stop_all(self, grace_seconds: float = 10.0) -> None:
        """End every engine this process started (at shutdown)."""
        for instance_id in list(self._instances):
            self.stop(instance_id, grace_seconds)


_local: LocalHostDriver | None = None
_local_lock = threading.Lock()


def local_driver() -> LocalHostDriver:
    """This process's driver for the standalone host."""
    global _local  # noqa: PLW0603 - one driver per process owns the engine children
    with _local_lock:
        if _local is None:
            probe = make_probe(settings.CAPYCTL["SIM_GPUS"], settings.CAPYCTL["SIM_STATE_DIR"])
            _local = LocalHostDriver(probe, Path(settings.DATA_DIR) / "logs")
        return _local


def set_local_driver(driver: LocalHostDriver | None) -> None:
    """Replace this process's local driver (tests give each case its own)."""
    global _local  # noqa: PLW0603 - see local_driver
    with _local_lock:
        _local = driver


def driver_for(host: Host) -> HostDriver:
    if host.is_local:
        return local_driver()
    raise UserError(
        f"host {host.name} is a remote host; this installation drives only its local host"
    )
