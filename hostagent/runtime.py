"""Running engine instances on this host: launch, readiness, park, wake, stop.

This is what the control plane drives, in-process for the standalone host and through the
host agent elsewhere. It trusts no engine's word alone: a park is confirmed with the GPU
probe's per-process figures before it counts as done.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostagent.errors import (
    EngineCallError,
    EngineExitedError,
    EngineExposedError,
    MemoryNotReleasedError,
)
from hostagent.kinds import EngineClient, EngineKind, LaunchSpec, get_kind
from hostagent.probe import Probe, ProcessUsage, SimulatedProbe
from hostagent.process import (
    DEFAULT_LOG_MAX_BYTES,
    EngineProcess,
    adopt_process,
    exposed_listeners,
    start_process,
    stop_process,
    wait_ready,
)
from hostagent.simgpu import SIM_GPUS_ENV, SIM_STATE_ENV
from hostagent.units import format_size

logger = logging.getLogger("hostagent.runtime")

# A park counts as released when each GPU's figure fell to at most this share of what it
# was: engines keep a residual (CUDA context, graphs) that is small next to their claim.
RELEASED_SHARE = 0.5


# Ports handed out lately, by when: the kernel may give a port that was just free to the
# next bind, and an engine binds its port only once it runs, so two engines launched
# together could be told the same one (the second's health check then reaches the first).
_GIVEN: dict[int, float] = {}
_GIVEN_LOCK = threading.Lock()
_GIVEN_SECONDS = 120.0


def free_port() -> int:
    """A TCP port free on the loopback interface right now, and not handed out by this
    process in the last two minutes."""
    with _GIVEN_LOCK:
        now = time.monotonic()
        for port, when in list(_GIVEN.items()):
            if now - when > _GIVEN_SECONDS:
                del _GIVEN[port]
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in _GIVEN:
                _GIVEN[port] = now
                return port


@dataclass(frozen=True)
class InstanceRequest:
    """What the control plane asks for: one engine serving one deployment."""

    instance_id: str
    kind: str
    command: str
    source: str
    served_name: str
    extra_args: list[str] = field(default_factory=list)
    gpu_indices: list[int] | None = None
    env: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    ram_park: bool = True
    memory_fraction: float | None = None


@dataclass
class Instance:
    """A launched engine: its process, its loopback port and launch key, its state."""

    request: InstanceRequest
    kind: EngineKind
    spec: LaunchSpec
    process: EngineProcess
    client: EngineClient
    parked_mode: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def port(self) -> int:
        return self.spec.port

    @property
    def api_key(self) -> str:
        return self.spec.api_key

    @property
    def base_url(self) -> str:
        return self.client.base_url


# How long after a park the probe may take to show the memory freed (a vLLM sleep frees
# it before answering; NVML sees it at once): ``CAPYCTL_PARK_CONFIRM_SECONDS``.
DEFAULT_RELEASE_SECONDS = 10.0


class EngineRuntime:
    """Launches and drives engine instances on this host."""

    def __init__(
        self,
        probe: Probe,
        log_dir: Path,
        *,
        log_max_bytes: int = DEFAULT_LOG_MAX_BYTES,
        release_timeout: float = DEFAULT_RELEASE_SECONDS,
    ) -> None:
        self.probe = probe
        self.log_dir = log_dir
        self.log_max_bytes = log_max_bytes
        self.release_timeout = release_timeout

    def _probe_env(self) -> dict[str, str]:
        if isinstance(self.probe, SimulatedProbe):
            spec = self.probe.spec
            sizes = ",".join(str(size) for size in spec.sizes)
            return {
                SIM_GPUS_ENV: f"unified:{sizes}" if spec.unified else sizes,
                SIM_STATE_ENV: str(self.probe.state_dir),
            }
        return {}

    def _spec(self, request: InstanceRequest, port: int, api_key: str) -> LaunchSpec:
        return LaunchSpec(
            command=request.command,
            source=request.source,
            served_name=request.served_name,
            port=port,
            api_key=api_key,
            extra_args=list(request.extra_args),
            gpu_indices=request.gpu_indices,
            env={**self._probe_env(), **request.env},
            options=dict(request.options),
            ram_park=request.ram_park,
            memory_fraction=request.memory_fraction,
        )

    def adopt(
        self, request: InstanceRequest, *, port: int, api_key: str, pid: int, create_time: float
    ) -> Instance | None:
        """Take back an engine an earlier run of this process started, if it still runs."""
        log_path = self.log_dir / f"{request.instance_id}.log"
        process = adopt_process(pid, create_time, log_path, self.log_max_bytes)
        if process is None:
            return None
        spec = self._spec(request, port, api_key)
        return Instance(
            request=request,
            kind=get_kind(request.kind),
            spec=spec,
            process=process,
            client=EngineClient(spec.port, spec.api_key),
        )

    def launch(self, request: InstanceRequest) -> Instance:
        """Start the engine process; it is not ready yet (see :meth:`wait_ready`)."""
        kind = get_kind(request.kind)
        # A key that never starts with "-", which flag parsers would misread.
        spec = self._spec(request, free_port(), secrets.token_hex(24))
        launch = kind.build_launch(spec)
        log_path = self.log_dir / f"{request.instance_id}.log"
        process = start_process(
            launch.argv, env=launch.env, log_path=log_path, log_max_bytes=self.log_max_bytes
        )
        logger.info(
            "started %s engine for %s: pid %s on 127.0.0.1:%s",
            kind.name,
            request.served_name,
            process.pid,
            spec.port,
        )
        return Instance(
            request=request,
            kind=kind,
            spec=spec,
            process=process,
            client=EngineClient(spec.port, spec.api_key),
        )

    def wait_ready(self, instance: Instance, timeout: float) -> float:
        """Wait for health, then warm up; return the seconds it took."""
        what = f"{instance.kind.name} engine for {instance.request.served_name}"
        started = time.monotonic()
        wait_ready(
            instance.process,
            lambda: instance.kind.is_healthy(instance.client, instance.spec),
            timeout=timeout,
            what=what,
        )
        self._check_loopback(instance, what)
        self._call(instance, lambda: instance.kind.warm_up(instance.client, instance.spec))
        return time.monotonic() - started

    def _check_loopback(self, instance: Instance, what: str) -> None:
        """An engine that listens beyond loopback exposes routes no key guards (vLLM's
        ``/sleep``): it is stopped at once, and the start fails saying where it listened."""
        exposed = exposed_listeners(instance.pid, instance.port)
        if not exposed:
            return
        stop_process(instance.process, grace_seconds=2.0)
        raise EngineExposedError(
            f"{what} listens on {', '.join(exposed)}, not on 127.0.0.1 and ::1 only, so "
            "it was stopped (does its command or args set another address?)"
        )

    def usage(self, instance: Instance) -> ProcessUsage:
        """What the probe sees the instance's process tree hold now."""
        return self.probe.process_usage(instance.pid)

    def _call(self, instance: Instance, action: Any) -> None:
        """Run a control call; if the engine died meanwhile, say so with its last logs."""
        try:
            action()
        except EngineCallError:
            code = instance.process.exit_code()
            if code is not None:
                raise EngineExitedError(
                    f"{instance.kind.name} engine for {instance.request.served_name} exited "
                    f"with status {code}",
                    code,
                    instance.process.log_tail(),
                ) from None
            raise

    def park(self, instance: Instance, mode: str, timeout: float = 600.0) -> ProcessUsage:
        """Park in ``mode`` and confirm with the probe; return what is left (the residual).

        Raises :class:`~hostagent.errors.CannotParkError` when the kind cannot, and
        :class:`~hostagent.errors.MemoryNotReleasedError` when the engine says it parked
        but the probe does not show the memory released within ``release_timeout``.
        """
        before = self.usage(instance)
        assigned = instance.request.gpu_indices or []
        if assigned and not all(before.gpu.get(i) is not None for i in assigned):
            # Without a reading for each of its GPUs, a release could never be confirmed.
            before = ProcessUsage(gpu={i: before.gpu.get(i) for i in assigned}, host_bytes=0)
        with _client_for(instance, timeout) as client:
            self._call(instance, lambda: instance.kind.park(client, instance.spec, mode))
        instance.parked_mode = mode
        deadline = time.monotonic() + self.release_timeout
        while True:
            now = self.usage(instance)
            if _released(before, now):
                return now
            if time.monotonic() >= deadline:
                raise MemoryNotReleasedError(
                    f"{instance.kind.name} engine for {instance.request.served_name} answered "
                    f"the {mode} park, but the GPU probe still sees its memory "
                    f"({_describe(now)}; before: {_describe(before)})",
                    still_held=now.gpu,
                )
            time.sleep(0.05)

    def wake(self, instance: Instance, mode: str, timeout: float) -> float:
        """Wake from a ``mode`` park and wait until healthy; return the seconds it took."""
        started = time.monotonic()
        with _client_for(instance, timeout) as client:
            self._call(instance, lambda: instance.kind.wake(client, instance.spec, mode))
        instance.parked_mode = None
        remaining = max(timeout - (time.monotonic() - started), 1.0)
        wait_ready(
            instance.process,
            lambda: instance.kind.is_healthy(instance.client, instance.spec),
            timeout=remaining,
            what=f"{instance.kind.name} engine for {instance.request.served_name}",
        )
        return time.monotonic() - started

    def stop(self, instance: Instance, grace_seconds: float = 10.0) -> int:
        """End the engine process (SIGTERM, then SIGKILL); return its exit status."""
        instance.client.close()
        code = stop_process(instance.process, grace_seconds=grace_seconds)
        logger.info(
            "stopped %s engine for %s (pid %s, status %s)",
            instance.kind.name,
            instance.request.served_name,
            instance.pid,
            code,
        )
        return code


@contextlib.contextmanager
def _client_for(instance: Instance, timeout: float) -> Iterator[EngineClient]:
    """The instance's control client, its calls giving up after ``timeout`` meanwhile (a
    hung engine never blocks). Park and wake of one instance never overlap."""
    with instance.client.default_timeout(timeout):
        yield instance.client


def _released(before: ProcessUsage, now: ProcessUsage) -> bool:
    if not now.gpu_known or not before.gpu_known:
        return False  # unknown per-process figures can never confirm a release
    for index, held_before in before.gpu.items():
        held_now = now.gpu.get(index) or 0
        if held_before and held_now > held_before * RELEASED_SHARE:
            return False
    return True


def _describe(usage: ProcessUsage) -> str:
    parts = [
        f"gpu{index} {'unknown' if value is None else format_size(value)}"
        for index, value in sorted(usage.gpu.items())
    ]
    return ", ".join(parts) or "no GPU memory"
