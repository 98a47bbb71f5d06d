"""Running engine instances on this host: launch, readiness, park, wake, stop.

This is what the control plane drives, in-process for the standalone host and through the
host agent elsewhere. It trusts no engine's word alone: a park is confirmed with the GPU
probe's per-process figures before it counts as done, or, where the probe cannot see the
engine's processes, by its GPUs' used memory falling (:mod:`hostagent.measure`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import shutil
import socket
import tempfile
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
from hostagent.kinds.base import SOCKET_PATH_MAX
from hostagent.measure import (
    LAUNCH_LEASE_SECONDS,
    LEASE_MARGIN_SECONDS,
    RELEASED_SHARE,
    DeviceMeter,
    Lease,
    release_tolerance,
    released_on_device,
)
from hostagent.probe import DEVICE, Probe, ProcessUsage, SimulatedProbe
from hostagent.process import (
    DEFAULT_LOG_MAX_BYTES,
    EngineProcess,
    adopt_process,
    exposed_listeners,
    socket_held,
    start_process,
    stop_process,
    wait_ready,
)
from hostagent.rundir import prepare_run_dir, remove_run_dir
from hostagent.simgpu import SIM_GPUS_ENV, SIM_STATE_ENV
from hostagent.units import format_size
from hostagent.versions import EngineFeatures, EngineProbeError, check_flags, detect

logger = logging.getLogger("hostagent.runtime")


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
    claim_bytes: int | None = None  # the ledger's claim per GPU, for engines that take a size
    # Hosts whose media URLs the engine may fetch (empty: none); None: no policy, no flag.
    media_domains: list[str] | None = None


SOCKET_NAME = "engine.sock"  # llama-server takes a path ending in .sock as a socket
SHORT_DIR_PREFIX = "capyctl-"


def socket_path_for(run_dir: Path) -> Path | None:
    """Where an engine whose run dir is ``run_dir`` listens: ``engine.sock`` in that 0700
    dir; where that path is too long for a socket (``SOCKET_PATH_MAX``), in a 0700 dir of
    its own made in the system's temporary dir (``mkdtemp``: a new name, made by this
    user, never one that was there); None where even that is too long."""
    path = run_dir / SOCKET_NAME
    if len(bytes(path)) <= SOCKET_PATH_MAX:
        return path
    short = Path(tempfile.mkdtemp(prefix=SHORT_DIR_PREFIX)) / SOCKET_NAME
    if len(bytes(short)) <= SOCKET_PATH_MAX:
        return short
    short.parent.rmdir()
    return None


def remove_socket_dir(socket_path: Path | None, run_dir: Path) -> None:
    """The short dir :func:`socket_path_for` made for a socket outside its run dir."""
    if socket_path is None or socket_path.parent == run_dir:
        return
    if socket_path.parent.name.startswith(SHORT_DIR_PREFIX):
        shutil.rmtree(socket_path.parent, ignore_errors=True)


@dataclass
class Instance:
    """A launched engine: its process, its Unix socket or loopback port, its launch key,
    its state.

    ``measured_by``: how its GPU memory is read (``None`` until its start showed it). On
    the device path ``device_held`` is what it holds per GPU, as its steps measured it (its
    share once ready, its residual once parked; ``None``: unknown). ``start_before`` (the
    GPUs' use before its launch) and ``lease`` (its GPUs, held) last while a step does."""

    request: InstanceRequest
    kind: EngineKind
    spec: LaunchSpec
    process: EngineProcess
    client: EngineClient
    parked_mode: str | None = None
    measured_by: str | None = None
    device_held: dict[int, int | None] = field(default_factory=dict)
    start_before: dict[int, int] | None = None
    lease: Lease | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def port(self) -> int:
        """Its loopback port; 0 where it listens on a Unix socket."""
        return self.spec.port

    @property
    def socket_path(self) -> Path | None:
        return self.spec.socket_path

    @property
    def api_key(self) -> str:
        return self.spec.api_key

    @property
    def base_url(self) -> str:
        return self.client.base_url


ASK_SECONDS = 5.0  # how long a question to an engine about its state may take

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
        self.meter = DeviceMeter(probe)
        self.log_dir = log_dir
        self.run_root = log_dir.parent / "run"  # each instance's run dir: its key file
        self.log_max_bytes = log_max_bytes
        self.release_timeout = release_timeout
        # What each engine program said of itself here, asked once before its first launch.
        self._features: dict[tuple[str, str, tuple[tuple[str, str], ...]], EngineFeatures] = {}
        self._features_lock = threading.Lock()

    def features(self, request: InstanceRequest) -> EngineFeatures | None:
        """The version and flags of the request's engine program on this host (run once per
        kind, command and env); None where its kind does not ask."""
        kind = get_kind(request.kind)
        if kind.probes is None:
            return None
        key = (request.kind, request.command, tuple(sorted(request.env.items())))
        with self._features_lock:
            known = self._features.get(key)
        if known is not None:
            return known
        # Asked outside the lock: one slow program never holds up another's launch (two
        # first launches of the same one may both ask; they hear the same answer).
        try:
            argv = kind.check_command(request.command)
            found = detect(argv, kind.probes, env=dict(request.env))
        except (EngineProbeError, ValueError) as exc:
            # The launch itself will say what is wrong; the flags go unchecked.
            # Not kept: the program may be installed by the next launch.
            logger.warning("could not read the %s engine's version: %s", kind.name, exc)
            return EngineFeatures(version="", note=f"version unknown: {exc}")
        else:
            logger.info("%s engine %s: %s", kind.name, request.command, found.version)
        with self._features_lock:
            return self._features.setdefault(key, found)

    def _probe_env(self) -> dict[str, str]:
        if isinstance(self.probe, SimulatedProbe):
            spec = self.probe.spec
            sizes = ",".join(str(size) for size in spec.sizes)
            return {
                SIM_GPUS_ENV: f"unified:{sizes}" if spec.unified else sizes,
                SIM_STATE_ENV: str(self.probe.state_dir),
            }
        return {}

    def _spec(
        self,
        request: InstanceRequest,
        port: int,
        api_key: str,
        socket_path: Path | None = None,
    ) -> LaunchSpec:
        return LaunchSpec(
            socket_path=socket_path,
            features=self.features(request),
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
            claim_bytes=request.claim_bytes,
            media_domains=request.media_domains,
            run_dir=self.run_root / request.instance_id,
        )

    def adopt(
        self,
        request: InstanceRequest,
        *,
        port: int,
        api_key: str,
        pid: int,
        create_time: float,
        socket_path: Path | None = None,
    ) -> Instance | None:
        """Take back an engine an earlier run of this process started, if it still runs."""
        log_path = self.log_dir / f"{request.instance_id}.log"
        process = adopt_process(pid, create_time, log_path, self.log_max_bytes)
        if process is None:
            return None
        process.hidden = (api_key,)
        spec = self._spec(request, port, api_key, socket_path)
        return Instance(
            request=request,
            kind=get_kind(request.kind),
            spec=spec,
            process=process,
            client=_client(spec),
        )

    def _listen_at(self, kind: EngineKind, spec: LaunchSpec) -> LaunchSpec:
        """The spec with where the engine listens: a Unix socket in its run dir where its
        program can, else a loopback port."""
        if spec.run_dir is not None and kind.socket_listening(spec.features):
            path = socket_path_for(spec.run_dir)
            if path is not None:
                return dataclasses.replace(spec, socket_path=path)
            logger.warning(
                "%s: no socket path short enough under %s or the temporary dir; it listens "
                "on loopback TCP",
                spec.served_name,
                spec.run_dir,
            )
        return dataclasses.replace(spec, port=free_port())

    def launch(self, request: InstanceRequest) -> Instance:
        """Start the engine process; it is not ready yet (see :meth:`wait_ready`). Where its
        start may be measured by device, its GPUs are held from here until it is ready."""
        kind = get_kind(request.kind)
        # A key that never starts with "-", which flag parsers would misread.
        spec = self._spec(request, 0, secrets.token_hex(24))
        if getattr(kind, "sizes_by_free_memory", False):  # SGLang's and llama-server's
            spec = dataclasses.replace(spec, gpu_memory=self._memory_at_launch(request))
        if spec.features is not None:  # a flag this build lacks: one line, not an exit
            spelling = kind.probes.spelling if kind.probes is not None else None
            check_flags(f"{kind.name} on this host", spec.features, request.extra_args, spelling)
        spec = self._listen_at(kind, spec)  # from here on, its socket's folder may exist
        log_path = self.log_dir / f"{request.instance_id}.log"
        run_dir = self.run_root / request.instance_id
        lease = None
        try:
            launch = kind.build_launch(spec)
            gpus = self.meter.gpus(request.gpu_indices)
            if gpus and self.meter.leases_starts():
                lease = self.meter.leases.acquire(
                    f"the start of {request.served_name}", gpus, LAUNCH_LEASE_SECONDS
                )
            prepare_run_dir(run_dir, launch.files)
            before = self.meter.used(gpus) if lease is not None else None
            process = start_process(
                launch.argv, env=launch.env, log_path=log_path, log_max_bytes=self.log_max_bytes
            )
            process.hidden = (spec.api_key,)
        except BaseException:
            remove_run_dir(run_dir)
            remove_socket_dir(spec.socket_path, run_dir)
            if lease is not None:
                self.meter.leases.release(lease)
            raise
        logger.info(
            "started %s engine for %s: pid %s on %s",
            kind.name,
            request.served_name,
            process.pid,
            spec.socket_path or f"127.0.0.1:{spec.port}",
        )
        return Instance(
            request=request,
            kind=kind,
            spec=spec,
            process=process,
            client=_client(spec),
            start_before=before,
            lease=lease,
        )

    def _memory_at_launch(self, request: InstanceRequest) -> list[tuple[int, int]] | None:
        """Each of the request's GPUs' (free, total) bytes now, in the engine's order
        (None: it has no claim, or a GPU gave no reading)."""
        if request.claim_bytes is None:
            return None
        found = {r.index: (r.free_bytes, r.total_bytes) for r in self.probe.devices()}
        order = request.gpu_indices if request.gpu_indices is not None else sorted(found)
        if not order or any(index not in found for index in order):
            return None
        return [found[index] for index in order]

    def wait_ready(self, instance: Instance, timeout: float) -> float:
        """Wait for health, then warm up; return the seconds it took. A start held on its
        GPUs is measured here, once warm, and its GPUs let go."""
        what = f"{instance.kind.name} engine for {instance.request.served_name}"
        started = time.monotonic()
        lease = instance.lease  # its launch's, where its start is measured
        if lease is not None:
            self.meter.leases.renew(lease, timeout + LEASE_MARGIN_SECONDS)
        try:
            wait_ready(
                instance.process,
                lambda: instance.kind.is_healthy(instance.client, instance.spec),
                timeout=timeout,
                what=what,
            )
            self._check_loopback(instance, what)
            self._call(instance, lambda: instance.kind.warm_up(instance.client, instance.spec))
            if instance.start_before is not None:
                self._measure_start(instance, instance.start_before)
        finally:
            instance.start_before = None
            self._unlease(instance, lease)
        return time.monotonic() - started

    def _measure_start(self, instance: Instance, before: dict[int, int]) -> None:
        """Decide how the instance is measured from its GPUs' growth over its start and
        what the probe shows its processes holding; on the device path, its share is that
        growth (unknown if its lease was lost)."""
        after = self.meter.used(list(before))
        grew = {index: after.get(index, 0) - used for index, used in before.items()}
        seen = self.probe.process_usage(instance.pid)
        what = f"{instance.request.served_name} (pid {instance.pid})"
        instance.measured_by = self.meter.judge_start(seen, grew, what)
        if instance.measured_by == DEVICE:
            intact = instance.lease is not None and not instance.lease.lost
            instance.device_held = {i: max(g, 0) if intact else None for i, g in grew.items()}
            logger.info(
                "%s holds %s, measured by device", what, _describe_gpu(instance.device_held)
            )

    def _hold(self, instance: Instance, step: str, seconds: float) -> Lease | None:
        """Hold the instance's GPUs for ``step``, where steps are measured by device."""
        gpus = self.meter.gpus(instance.request.gpu_indices)
        if not gpus or not self.meter.leases_steps():
            return None
        lease = self.meter.leases.acquire(
            f"the {step} of {instance.request.served_name}", gpus, seconds
        )
        instance.lease = lease
        return lease

    def _unlease(self, instance: Instance, lease: Lease | None) -> None:
        """Let go of a step's GPUs (a stop may have ended its lease already)."""
        if lease is None:
            return
        self.meter.leases.release(lease)
        if instance.lease is lease:
            instance.lease = None

    def _check_loopback(self, instance: Instance, what: str) -> None:
        """An engine that listens beyond loopback exposes routes no key guards (vLLM's
        ``/sleep``): it is stopped at once, and the start fails saying where it listened.
        One launched on a socket must hold that socket itself: an answer there from any
        other process is not its own."""
        exposed = exposed_listeners(instance.pid, instance.port)
        if exposed:
            self._refuse_start(
                instance,
                f"{what} listens on {', '.join(exposed)}, not on 127.0.0.1 and ::1 only, so "
                "it was stopped (does its command or args set another address?)",
            )
        path = instance.socket_path
        if path is not None and not socket_held(instance.pid, path):
            self._refuse_start(
                instance,
                f"{what} answered on {path}, but no process of its own listens there, so "
                "it was stopped",
            )

    def _refuse_start(self, instance: Instance, message: str) -> None:
        stop_process(instance.process, grace_seconds=2.0)
        run_dir = self.run_root / instance.request.instance_id
        remove_run_dir(run_dir)
        remove_socket_dir(instance.socket_path, run_dir)
        raise EngineExposedError(message)

    def asleep(self, instance: Instance) -> bool | None:
        """Whether the engine says it is parked now, asked on a client of its own with a
        short timeout (never the one a park or wake is using); None where its kind cannot
        tell, it has ended, or it does not answer."""
        if not instance.process.alive():
            return None
        client = EngineClient(
            instance.port, instance.api_key, timeout=ASK_SECONDS, socket_path=instance.socket_path
        )
        try:
            return instance.kind.asleep(client, instance.spec)
        except EngineCallError:
            return None
        finally:
            client.close()

    def usage(self, instance: Instance) -> ProcessUsage:
        """What the instance's process tree holds now: the probe's figures, or on the device
        path what its steps measured (while its start is measured: what its GPUs grew by so
        far, so that it is never counted as someone else's)."""
        seen = self.probe.process_usage(instance.pid)
        if instance.measured_by == DEVICE:
            return ProcessUsage(gpu=dict(instance.device_held), host_bytes=seen.host_bytes)
        before = instance.start_before
        if before is not None and not any(seen.gpu.get(i) for i in before):
            now = self.meter.used(list(before))
            grown = {i: max(now.get(i, 0) - used, 0) for i, used in before.items()}
            return ProcessUsage(gpu={**seen.gpu, **grown}, host_bytes=seen.host_bytes)
        return seen

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
        seconds = timeout + self.release_timeout + LEASE_MARGIN_SECONDS
        lease = self._hold(instance, f"{mode} park", seconds)
        try:
            if instance.measured_by == DEVICE:
                return self._park_by_device(instance, mode, timeout, lease)
            return self._park_per_process(instance, mode, timeout)
        finally:
            self._unlease(instance, lease)

    def _park_per_process(self, instance: Instance, mode: str, timeout: float) -> ProcessUsage:
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

    def _park_by_device(
        self, instance: Instance, mode: str, timeout: float, lease: Lease | None
    ) -> ProcessUsage:
        """A park confirmed by each of its GPUs' used memory falling by the instance's share
        there, less :func:`~hostagent.measure.release_tolerance`; what stays is its
        residual."""
        share = dict(instance.device_held)
        before = self.meter.used(list(share))
        with _client_for(instance, timeout) as client:
            self._call(instance, lambda: instance.kind.park(client, instance.spec, mode))
        instance.parked_mode = mode
        deadline = time.monotonic() + self.release_timeout
        while True:
            now = self.meter.used(list(share))
            fell = {i: before.get(i, 0) - now.get(i, 0) for i in share}
            intact = lease is not None and not lease.lost
            if intact and all(
                held is not None and released_on_device(held, fell[i]) for i, held in share.items()
            ):
                instance.device_held = {
                    i: max((held or 0) - fell[i], 0) for i, held in share.items()
                }
                return self.usage(instance)
            if time.monotonic() >= deadline:
                raise MemoryNotReleasedError(
                    f"{instance.kind.name} engine for {instance.request.served_name} answered "
                    f"the {mode} park, but its GPUs' used memory did not fall by its share "
                    f"({_describe_fall(share, fell)})",
                    still_held={
                        i: None if held is None else max(held - fell[i], 0)
                        for i, held in share.items()
                    },
                )
            time.sleep(0.05)

    def wake(self, instance: Instance, mode: str, timeout: float) -> float:
        """Wake from a ``mode`` park and wait until healthy; return the seconds it took. On
        the device path what its GPUs grew by is added to what it kept parked."""
        started = time.monotonic()
        lease = self._hold(instance, f"{mode} wake", timeout + LEASE_MARGIN_SECONDS)
        try:
            before = self.meter.used(list(instance.device_held))
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
            if instance.measured_by == DEVICE:
                after = self.meter.used(list(before))
                intact = lease is not None and not lease.lost
                instance.device_held = {
                    i: None if held is None or not intact
                    else held + max(after.get(i, 0) - before.get(i, 0), 0)
                    for i, held in instance.device_held.items()
                }  # fmt: skip
        finally:
            self._unlease(instance, lease)
        return time.monotonic() - started

    def stop(self, instance: Instance, grace_seconds: float = 10.0) -> int:
        """End the engine process (SIGTERM, then SIGKILL); return its exit status. A step of
        the instance still under way is cut short: what it measures no longer counts."""
        instance.client.close()
        if instance.lease is not None:
            self.meter.leases.end(instance.lease)
            instance.lease = None
        # SIGKILL's own wait is 30 s (hostagent.process): the lease outlasts it.
        lease = self._hold(instance, "stop", grace_seconds + 30 + LEASE_MARGIN_SECONDS)
        try:
            code = stop_process(instance.process, grace_seconds=grace_seconds)
        finally:
            self._unlease(instance, lease)
            run_dir = self.run_root / instance.request.instance_id
            remove_run_dir(run_dir)
            remove_socket_dir(instance.socket_path, run_dir)
        logger.info(
            "stopped %s engine for %s (pid %s, status %s)",
            instance.kind.name,
            instance.request.served_name,
            instance.pid,
            code,
        )
        return code


def _client(spec: LaunchSpec) -> EngineClient:
    """The control client of a launch: over its socket, or to its loopback port."""
    return EngineClient(spec.port, spec.api_key, socket_path=spec.socket_path)


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


def _describe_gpu(gpu: dict[int, int | None]) -> str:
    parts = [
        f"gpu{index} {'unknown' if value is None else format_size(value)}"
        for index, value in sorted(gpu.items())
    ]
    return ", ".join(parts) or "no GPU memory"


def _describe_fall(share: dict[int, int | None], fell: dict[int, int]) -> str:
    parts = []
    for index, held in sorted(share.items()):
        if held is None:
            parts.append(f"gpu{index}: its share is unknown")
        else:
            needed = held - release_tolerance(held)
            parts.append(
                f"gpu{index} fell by {format_size(max(fell[index], 0))}, of its "
                f"{format_size(held)}: at least {format_size(needed)} needed"
            )
    return "; ".join(parts)


def _describe(usage: ProcessUsage) -> str:
    parts = [
        f"gpu{index} {'unknown' if value is None else format_size(value)}"
        for index, value in sorted(usage.gpu.items())
    ]
    return ", ".join(parts) or "no GPU memory"
