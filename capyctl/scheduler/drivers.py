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
from capyctl.scheduler.remote_hosts import RemoteHostDriver
from hostagent.host import HostRuntime, Launched
from hostagent.probe import DeviceReading, Inventory, ProcessUsage, make_probe
from hostagent.runtime import InstanceRequest
from hostagent.sources import FetchStatus


class HostDriver(Protocol):
    def inventory(self) -> Inventory: ...

    def devices(self) -> list[DeviceReading]: ...

    def launch(self, request: InstanceRequest) -> Launched: ...

    def wait_ready(self, instance_id: str, timeout: float) -> float: ...

    def park(self, instance_id: str, mode: str, timeout: float) -> ProcessUsage: ...

    def wake(self, instance_id: str, mode: str, timeout: float) -> float: ...

    def load_adapter(self, instance_id: str, name: str, source: str, timeout: float) -> float: ...

    def unload_adapter(self, instance_id: str, name: str) -> None: ...

    def loaded_adapters(self, instance_id: str) -> list[str] | None: ...

    def stop(self, instance_id: str, grace_seconds: float) -> int: ...

    def usage(self, instance_id: str) -> ProcessUsage: ...

    def asleep(self, instance_id: str) -> bool | None: ...

    def alive(self, instance_id: str) -> bool: ...

    def known(self, instance_id: str) -> bool: ...

    def exit_report(self, instance_id: str) -> tuple[int | None, str]: ...

    def foreign(self, unified: bool) -> dict[str, int]: ...

    def instance_ids(self) -> list[str]: ...

    def fetch_start(self, source: str) -> FetchStatus: ...

    def fetch_status(self, source: str) -> FetchStatus | None: ...

    def downloads(self) -> list[dict[str, object]]: ...

    def prune(self, keep: list[str], dry_run: bool) -> list[dict[str, object]]: ...


class LocalHostDriver(HostRuntime):
    """Standalone's host ``local``: the engines are this process's children."""


_local: LocalHostDriver | None = None
_local_lock = threading.Lock()


def local_driver() -> LocalHostDriver:
    """This process's driver for the standalone host."""
    global _local  # noqa: PLW0603 - one driver per process owns the engine children
    with _local_lock:
        if _local is None:
            probe = make_probe(settings.CAPYCTL["SIM_GPUS"], settings.CAPYCTL["SIM_STATE_DIR"])
            _local = LocalHostDriver(
                probe,
                Path(settings.DATA_DIR) / "logs",
                release_timeout=settings.CAPYCTL["PARK_CONFIRM_SECONDS"],
            )
        return _local


def set_local_driver(driver: LocalHostDriver | None) -> None:
    """Replace this process's local driver (tests give each case its own)."""
    global _local  # noqa: PLW0603 - see local_driver
    with _local_lock:
        _local = driver


def driver_for(host: Host) -> HostDriver:
    """The local host in-process; any other through its agent, over mutual TLS."""
    if host.is_local:
        return local_driver()
    if host.enrolled_at is None:
        raise UserError(f"host {host.name} has not joined yet (capyctl start host --join …)")
    return RemoteHostDriver(host)
