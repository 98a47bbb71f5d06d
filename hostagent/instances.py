"""Engine instances: what the control plane asks for, a launched engine, where it listens.

:class:`InstanceRequest` is one engine serving one deployment, as asked; :class:`Instance`
is the engine launched for it. An engine listens on a Unix socket in its 0700 run dir
where its program can (:func:`socket_path_for`), else on a loopback port
(:func:`free_port`); its control client (:func:`engine_client`) reaches it there, and
:func:`call_engine` runs a control call, saying so with its last logs if the engine died.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hostagent.errors import EngineCallError, EngineExitedError
from hostagent.kinds import EngineClient, EngineKind, LaunchSpec
from hostagent.kinds.base import SOCKET_PATH_MAX
from hostagent.measure import Lease
from hostagent.process import EngineProcess

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
    # LoRA adapters (hostagent/kinds/adapters.py): GPU slots (0: none), the largest rank
    # (0: the engine's default), and (name, local path) of those loaded at launch (only
    # llama-server takes these).
    adapter_slots: int = 0
    adapter_max_rank: int = 0
    adapters: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InstanceRequest:
        """A request from its JSON form (the agent's API, the state file): adapters come
        as [name, path] pairs. Raises ValueError naming what is wrong."""
        try:
            request = cls(**data)
        except TypeError as exc:
            raise ValueError(f"bad instance request: {exc}") from None
        pairs = request.adapters
        if not isinstance(pairs, list) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, str) for x in p)
            for p in pairs
        ):
            raise ValueError("bad instance request: adapters must be [name, path] pairs")
        for name in ("adapter_slots", "adapter_max_rank"):
            value = getattr(request, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"bad instance request: {name} must be a whole number >= 0")
        return dataclasses.replace(request, adapters=[(str(n), str(p)) for n, p in pairs])


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


def engine_client(spec: LaunchSpec) -> EngineClient:
    """The control client of a launch: over its socket, or to its loopback port."""
    return EngineClient(spec.port, spec.api_key, socket_path=spec.socket_path)


@contextlib.contextmanager
def client_for(instance: Instance, timeout: float) -> Iterator[EngineClient]:
    """The instance's control client, its calls giving up after ``timeout`` meanwhile (a
    hung engine never blocks). Park and wake of one instance never overlap."""
    with instance.client.default_timeout(timeout):
        yield instance.client


def call_engine(instance: Instance, action: Callable[[], Any]) -> None:
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
