"""Running engine instances on this host: the runtime that launches, readies and stops them.

This is what the control plane drives, in-process for the standalone host and through the
host agent elsewhere: :class:`EngineRuntime` launches an engine (on a Unix socket or a free
loopback port, :mod:`hostagent.instances`), waits for it to be ready and measures its
start, parks and wakes it (:mod:`hostagent.parking`, which confirms each park with the GPU
probe), reports what it holds (:mod:`hostagent.instance_usage`) and stops it.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from pathlib import Path

from hostagent import instance_usage, parking
from hostagent.errors import EngineExposedError
from hostagent.instance_usage import describe_gpu, hold, unlease
from hostagent.instances import (
    Instance,
    InstanceRequest,
    call_engine,
    client_for,
    engine_client,
    free_port,
    remove_socket_dir,
    socket_path_for,
)
from hostagent.kinds import EngineKind, LaunchSpec, get_kind
from hostagent.measure import LAUNCH_LEASE_SECONDS, LEASE_MARGIN_SECONDS, DeviceMeter
from hostagent.parking import DEFAULT_RELEASE_SECONDS
from hostagent.probe import DEVICE, Probe, ProcessUsage, SimulatedProbe
from hostagent.process import (
    DEFAULT_LOG_MAX_BYTES,
    adopt_process,
    exposed_listeners,
    socket_held,
    start_process,
    stop_process,
    wait_ready,
)
from hostagent.rundir import prepare_run_dir, remove_run_dir
from hostagent.simgpu import SIM_GPUS_ENV, SIM_STATE_ENV
from hostagent.versions import EngineFeatures, EngineProbeError, check_flags, detect

# What the control plane and the host agent take from here.
__all__ = [
    "DEFAULT_RELEASE_SECONDS",
    "EngineRuntime",
    "Instance",
    "InstanceRequest",
    "free_port",
]

logger = logging.getLogger("hostagent.runtime")


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
            adapter_slots=request.adapter_slots,
            adapter_max_rank=request.adapter_max_rank,
            adapters=list(request.adapters),
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
            client=engine_client(spec),
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
                    f"the start of {request.served_name}", gpus, LAUNCH_LEASE_SECONDS, start=True
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
            client=engine_client(spec),
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
            call_engine(instance, lambda: instance.kind.warm_up(instance.client, instance.spec))
            if instance.start_before is not None:
                self._measure_start(instance, instance.start_before)
        finally:
            instance.start_before = None
            unlease(self.meter, instance, lease)
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
            logger.info("%s holds %s, measured by device", what, describe_gpu(instance.device_held))

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
        """Whether the engine says it is parked now; None where it cannot tell (see
        :func:`hostagent.instance_usage.asleep`)."""
        return instance_usage.asleep(instance)

    def usage(self, instance: Instance) -> ProcessUsage:
        """What the instance's process tree holds now (see
        :func:`hostagent.instance_usage.usage`)."""
        return instance_usage.usage(self.meter, instance)

    def park(self, instance: Instance, mode: str, timeout: float = 600.0) -> ProcessUsage:
        """Park in ``mode`` and confirm with the probe within ``release_timeout``; return
        what is left (the residual). See :func:`hostagent.parking.park`."""
        return parking.park(
            self.meter, instance, mode, timeout, release_timeout=self.release_timeout
        )

    def wake(self, instance: Instance, mode: str, timeout: float) -> float:
        """Wake from a ``mode`` park and wait until healthy; return the seconds it took.
        See :func:`hostagent.parking.wake`."""
        return parking.wake(self.meter, instance, mode, timeout)

    def load_adapter(self, instance: Instance, name: str, path: str, timeout: float) -> float:
        """Load the adapter at ``path`` into the engine as ``name``; the seconds it took."""
        started = time.monotonic()
        with client_for(instance, timeout) as client:
            call_engine(
                instance, lambda: instance.kind.load_adapter(client, instance.spec, name, path)
            )
        seconds = time.monotonic() - started
        logger.info(
            "loaded adapter %s into %s (%s) in %.2fs", name, instance.request.served_name,
            instance.request.instance_id, seconds,
        )  # fmt: skip
        return seconds

    def unload_adapter(self, instance: Instance, name: str) -> None:
        with client_for(instance, 60.0) as client:
            call_engine(instance, lambda: instance.kind.unload_adapter(client, instance.spec, name))

    def loaded_adapters(self, instance: Instance) -> list[str] | None:
        found: list[list[str] | None] = []
        with client_for(instance, 30.0) as client:
            call_engine(
                instance, lambda: found.append(instance.kind.loaded_adapters(client, instance.spec))
            )
        return found[0]

    def stop(self, instance: Instance, grace_seconds: float = 10.0) -> int:
        """End the engine process (SIGTERM, then SIGKILL); return its exit status. A step of
        the instance still under way is cut short: what it measures no longer counts."""
        instance.client.close()
        if instance.lease is not None:
            self.meter.leases.end(instance.lease)
            instance.lease = None
        # SIGKILL's own wait is 30 s (hostagent.process): the lease outlasts it.
        lease = hold(self.meter, instance, "stop", grace_seconds + 30 + LEASE_MARGIN_SECONDS)
        try:
            code = stop_process(instance.process, grace_seconds=grace_seconds)
        finally:
            unlease(self.meter, instance, lease)
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
