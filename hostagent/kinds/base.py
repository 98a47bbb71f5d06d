"""The contract every engine kind satisfies, and what the kinds share."""

from __future__ import annotations

import math
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hostagent.errors import AdapterError, CannotParkError, EngineCallError
from hostagent.kinds.client import LOOPBACK, EngineClient
from hostagent.sources import ENGINE_DOWNLOADS_OPTION, HUB_NAME_KINDS, engine_downloads
from hostagent.versions import EngineFeatures, ProbeCommands

# Engine control calls under /v1 (hostagent.routes lists the routes /v1 serves; these are
# CapyCTL's own calls to an engine): its model list, and vLLM's adapter routes.
MODELS_PATH = "/v1/models"
VLLM_LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"
VLLM_UNLOAD_ADAPTER_PATH = "/v1/unload_lora_adapter"

# Variables an engine takes API keys from: vLLM's VLLM_API_KEY, llama-server's LLAMA_API_KEY
# and LLAMA_ARG_API_KEY_FILE, TensorFold's TENSORFOLD_API_KEY. Only a kind sets one, with the
# launch key: from the host's environment or an engine's env they would open the engine to a
# key CapyCTL never made.
# TensorFold's TENSORFOLD_SLEEP_TOKEN opens its sleep routes the same way.
KEY_VARIABLES = frozenset(
    {
        "VLLM_API_KEY",
        "LLAMA_API_KEY",
        "LLAMA_ARG_API_KEY_FILE",
        "TENSORFOLD_API_KEY",
        "TENSORFOLD_SLEEP_TOKEN",
    }
)


class KindError(ValueError):
    """A kind was given something it cannot use."""


@dataclass(frozen=True)
class Capabilities:
    """``ram``: can copy weights to host RAM and give the GPU back while running.
    ``deep``: can drop its weights and reload them on wake."""

    ram: bool = False
    deep: bool = False
    # ``adapters``: can serve LoRA adapters beside its base model (launched with adapter
    # slots). ``runtime_adapters``: can load and unload them while running (else only
    # those named at launch).
    adapters: bool = False
    runtime_adapters: bool = False


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to build one engine launch."""

    command: str
    source: str
    served_name: str
    port: int
    api_key: str
    extra_args: list[str] = field(default_factory=list)
    gpu_indices: list[int] | None = None  # None: leave CUDA_VISIBLE_DEVICES alone
    env: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    ram_park: bool = True  # ask for what a later `ram` park needs (SGLang's CPU backup)
    memory_fraction: float | None = None  # share of each GPU the engine may take
    # The ledger's claim per GPU in bytes (None: none), for kinds whose engines take a size,
    # and each of its GPUs' (free, total) bytes at launch, in the engine's order (None: not
    # read), for kinds whose engines size themselves from the device's free memory.
    claim_bytes: int | None = None
    gpu_memory: list[tuple[int, int]] | None = None
    run_dir: Path | None = None  # the engine's own 0700 folder, for its key file
    # What this host's copy of the program said of itself (None: not asked).
    features: EngineFeatures | None = None
    # Hosts whose media URLs the engine may fetch (vLLM's and SGLang's
    # --allowed-media-domains; empty: none); None: no policy given, no flag.
    media_domains: list[str] | None = None
    # Where the engine listens instead of ``127.0.0.1:port``: a Unix socket in a 0700
    # folder of its own (None: loopback TCP, on ``port``).
    socket_path: Path | None = None
    # LoRA adapters (hostagent/kinds/adapters.py): how many the engine holds on its GPUs at
    # once (0: launched without adapter support), the largest rank it takes (0: the
    # engine's default), and (name, local path) of those loaded at launch, in order (only
    # engines that cannot load them at run time take these).
    adapter_slots: int = 0
    adapter_max_rank: int = 0
    adapters: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Launch:
    """An argument list (never run through a shell), the environment additions, and the
    files (path: text) to write 0600 in the run dir before the start. The launch key is
    never in ``argv``: every local user can read a command line (``ps``)."""

    argv: list[str]
    env: dict[str, str]
    files: dict[Path, str] = field(default_factory=dict)


class EngineKind(Protocol):
    """What CapyCTL knows about one engine program: how to launch, check, park, wake it."""

    name: str
    description: str

    @property
    def probes(self) -> ProbeCommands | None:
        """How to ask the program its version and flags (None: it is not asked)."""
        ...

    def capabilities(
        self, options: dict[str, Any], features: EngineFeatures | None = None
    ) -> Capabilities:
        """What it can do; ``features``: what the installed program said of itself."""
        ...

    def check_command(self, command: str) -> list[str]:
        """Split ``command`` into an argument list, or raise :class:`KindError`."""
        ...

    def check_args(self, args: list[str]) -> None:
        """Refuse extra engine arguments that would override what CapyCTL sets itself."""
        ...

    def check_options(self, options: dict[str, Any]) -> None:
        """Refuse kind-specific settings this kind does not understand."""
        ...

    def build_launch(self, spec: LaunchSpec) -> Launch: ...

    def socket_listening(self, features: EngineFeatures | None) -> bool:
        """Whether it can listen on a Unix socket (``spec.socket_path``) instead of TCP."""
        ...

    def is_healthy(self, client: EngineClient, spec: LaunchSpec) -> bool: ...

    def asleep(self, client: EngineClient, spec: LaunchSpec) -> bool | None:
        """Whether the engine says it is parked now (None: it cannot tell)."""
        ...

    def warm_up(self, client: EngineClient, spec: LaunchSpec) -> None:
        """Run the first tiny request where the engine needs one before it is fast."""
        ...

    def park(self, client: EngineClient, spec: LaunchSpec, mode: str) -> None:
        """Give back GPU memory (``ram`` or ``deep``); raise CannotParkError if unable."""
        ...

    def wake(self, client: EngineClient, spec: LaunchSpec, mode: str) -> None:
        """Take the GPU memory back after a park in ``mode``."""
        ...

    def load_adapter(self, client: EngineClient, spec: LaunchSpec, name: str, path: str) -> None:
        """Load the LoRA adapter at ``path`` (on this host) as ``name``; one already loaded
        is success. Raise :class:`AdapterError` with the engine's refusal."""
        ...

    def unload_adapter(self, client: EngineClient, spec: LaunchSpec, name: str) -> None:
        """Unload the adapter ``name``; one not loaded is success."""
        ...

    def loaded_adapters(self, client: EngineClient, spec: LaunchSpec) -> list[str] | None:
        """The adapters the engine has loaded now, by name (None: it cannot tell)."""
        ...


def split_command(command: str) -> list[str]:
    """Split a command line the way a POSIX shell would, without ever running a shell."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise KindError(f"invalid command {command!r}: {exc}") from None
    if not argv:
        raise KindError("invalid command: it is empty")
    return argv


# Flags CapyCTL sets on every launch, or that would replace what it sets: the loopback
# address, its port, and the key (which reaches each engine another way, never as a flag).
RESERVED_FLAGS = ("--host", "--port", "--api-key")
# Where a Unix socket's path may be at most this long (Linux's sun_path, less its NUL).
SOCKET_PATH_MAX = 107


def reserved_flag_in(arg: str, reserved: tuple[str, ...]) -> str | None:
    """The reserved flag ``arg`` would set, or None. Beyond the exact flag this catches
    ``--flag=value``, ``_`` for ``-`` (vLLM reads both) and the unique prefixes argparse
    accepts (``--ho`` for ``--host``)."""
    name = arg.split("=", 1)[0]
    if name in reserved:
        return name
    if not name.startswith("--") or len(name) < 3:
        return None
    name = "--" + name[2:].replace("_", "-")
    for flag in reserved:
        if flag.startswith("--") and flag.startswith(name):
            return flag
    return None


def check_reserved_flags(kind: str, args: list[str], reserved: tuple[str, ...]) -> None:
    for arg in args:
        flag = reserved_flag_in(arg, reserved)
        if flag is not None:
            given = arg.split("=", 1)[0]
            also = f" ({given} would be read as {flag})" if given != flag else ""
            raise KindError(
                f"engine args may not set {flag}{also}: CapyCTL sets it for every {kind} "
                "launch (engines listen on their own Unix socket or on 127.0.0.1 only, with "
                "a key CapyCTL makes)"
            )


def check_adapter_spec(kind: str, spec: LaunchSpec, reserved: tuple[str, ...]) -> None:
    """Refuse, in one line, adapter settings ``kind`` cannot honour: slots on a kind with no
    adapter flags (``reserved`` empty), adapters without slots, and a deployment's args
    that would set a flag the slots set."""
    if spec.adapter_slots < 0 or spec.adapter_max_rank < 0:
        raise KindError("adapter slots and the adapters' maximum rank cannot be negative")
    if spec.adapter_slots > 0 and not reserved:
        raise KindError(f"{kind} cannot serve LoRA adapters: launch it with no adapter slots")
    if spec.adapters and spec.adapter_slots <= 0:
        raise KindError(f"{len(spec.adapters)} adapters given to a {kind} launch with no slots")
    if spec.adapter_slots <= 0:
        return
    for arg in spec.extra_args:
        flag = reserved_flag_in(arg, reserved)
        if flag is not None:
            raise KindError(
                f"engine args may not set {flag}: CapyCTL sets it for a {kind} launch with "
                "adapter slots (set the deployment's adapter slots and maximum rank instead)"
            )


def loopback_flags(spec: LaunchSpec) -> list[str]:
    """``--host 127.0.0.1 --port P``: where an engine without a socket listens."""
    return ["--host", LOOPBACK, "--port", str(spec.port)]


def uds_flags(spec: LaunchSpec) -> list[str]:
    """``--uds PATH`` where the launch has a socket (vLLM and SGLang ignore or refuse
    ``--host`` and ``--port`` beside it), else :func:`loopback_flags`."""
    if spec.socket_path is None:
        return loopback_flags(spec)
    return ["--uds", str(spec.socket_path)]


def has_uds(features: EngineFeatures | None) -> bool:
    """Whether the installed program's help lists ``--uds`` (unknown: no)."""
    return features is not None and features.has("--uds")


def key_file_path(spec: LaunchSpec, name: str) -> Path:
    """Where the launch's key file ``name`` goes: in its run dir, which only its owner reads."""
    if spec.run_dir is None:
        raise KindError("this launch has no run directory for its key file")
    return spec.run_dir / name


def fraction_flag(spec: LaunchSpec, flag: str) -> list[str]:
    """``[flag, fraction]`` unless the deployment's own args already set ``flag``."""
    if spec.memory_fraction is None:
        return []
    if any(arg.split("=", 1)[0] == flag for arg in spec.extra_args):
        return []
    # Rounded down: the engine must never take more than the claim admitted for it.
    return [flag, f"{math.floor(spec.memory_fraction * 10000) / 10000:.4f}"]


def gpu_env(spec: LaunchSpec) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for the GPUs the launch was given, plus the engine's env
    (less any :data:`KEY_VARIABLES`: the kind sets the one its engine reads)."""
    env = {name: value for name, value in spec.env.items() if name not in KEY_VARIABLES}
    if spec.gpu_indices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_indices)
    return env


def wait_until(check: Any, timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``check()`` until it is true; raise EngineCallError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return
        if time.monotonic() >= deadline:
            raise EngineCallError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class ProgramKind:
    """Shared behaviour of kinds whose command is a program plus flags CapyCTL adds."""

    name = ""
    description = ""
    reserved_flags: tuple[str, ...] = RESERVED_FLAGS
    health_path = "/health"
    park_modes: tuple[str, ...] = ()
    probes: ProbeCommands | None = ProbeCommands()

    def socket_listening(self, features: EngineFeatures | None) -> bool:
        """Whether this program, as its help describes it, can listen on a Unix socket
        (then CapyCTL launches it there; else on loopback TCP)."""
        return False

    def asleep(self, client: EngineClient, spec: LaunchSpec) -> bool | None:
        """Whether the engine says it is parked now (None: it cannot tell)."""
        return None

    def capabilities(
        self, options: dict[str, Any], features: EngineFeatures | None = None
    ) -> Capabilities:
        return Capabilities(
            ram="ram" in self.park_modes,
            deep="deep" in self.park_modes,
            adapters=self.serves_adapters(features),
            runtime_adapters=self.loads_adapters(features),
        )

    # The flag whose presence in the program's help says it serves adapters (None: this
    # kind serves none). Unknown features (not asked): assumed to, the launch will tell.
    adapter_help_flag: str | None = None
    runtime_adapter_loading = False
    # Why an engine launched with adapter slots must not park deep ("": it may), where its
    # releases are known to fail to wake from a deep park with LoRA enabled.
    deep_park_with_adapters_fails = ""

    def serves_adapters(self, features: EngineFeatures | None) -> bool:
        flag = self.adapter_help_flag
        return flag is not None and (features is None or features.has(flag))

    def loads_adapters(self, features: EngineFeatures | None) -> bool:
        return self.runtime_adapter_loading and self.serves_adapters(features)

    def check_args(self, args: list[str]) -> None:
        check_reserved_flags(self.name, args, self.reserved_flags)

    def check_options(self, options: dict[str, Any]) -> None:
        if self.name in HUB_NAME_KINDS:
            value = options.get(ENGINE_DOWNLOADS_OPTION, False)
            if not isinstance(value, bool):
                raise KindError(
                    f"the engine option {ENGINE_DOWNLOADS_OPTION} is true or false (got {value!r})"
                )
            options = {k: v for k, v in options.items() if k != ENGINE_DOWNLOADS_OPTION}
        if options:
            only = (
                f"{self.name} takes only {ENGINE_DOWNLOADS_OPTION}"
                if self.name in HUB_NAME_KINDS
                else f"{self.name} takes no engine options"
            )
            raise KindError(
                f"{only} (got {', '.join(sorted(options))}); other options are for the "
                "'custom' kind"
            )

    def check_command(self, command: str) -> list[str]:
        argv = split_command(command)
        if any("{" in arg and "}" in arg for arg in argv):
            raise KindError(
                f"invalid command {command!r}: placeholders like {{port}} belong to the "
                f"'custom' kind; {self.name} gets its flags from CapyCTL"
            )
        return argv

    def build_launch(self, spec: LaunchSpec) -> Launch:
        argv = [
            *split_command(spec.command),
            *self.engine_flags(spec),
            *self.adapter_flags(spec),
            *spec.extra_args,
        ]
        env = {
            **self.offline_env(spec),
            **gpu_env(spec),
            **self.extra_env(spec),
            **(self.adapter_env(spec) if spec.adapter_slots > 0 else {}),
            **self.cap_env(spec),
            **self.key_env(spec),
        }
        return Launch(argv=argv, env=env, files=self.key_files(spec))

    def engine_flags(self, spec: LaunchSpec) -> list[str]:
        raise NotImplementedError

    # -- LoRA adapters (hostagent/kinds/adapters.py) ------------------------------------------

    # The flags a launch with adapter slots sets itself: a deployment's args may not set
    # them beside its adapter settings. Empty: this kind serves no adapters.
    adapter_reserved: tuple[str, ...] = ()

    def adapter_flags(self, spec: LaunchSpec) -> list[str]:
        """The flags that give the engine its adapter slots (none without slots); refuses
        adapters this kind cannot serve, and args that would set what the slots set."""
        check_adapter_spec(self.name, spec, self.adapter_reserved)
        if spec.adapter_slots <= 0:
            return []
        return self.slot_flags(spec)

    def slot_flags(self, spec: LaunchSpec) -> list[str]:
        raise NotImplementedError

    def adapter_env(self, spec: LaunchSpec) -> dict[str, str]:
        """Variables a launch with adapter slots needs."""
        return {}

    def load_adapter(self, client: EngineClient, spec: LaunchSpec, name: str, path: str) -> None:
        raise self.refuse_runtime_adapters()

    def unload_adapter(self, client: EngineClient, spec: LaunchSpec, name: str) -> None:
        raise self.refuse_runtime_adapters()

    def loaded_adapters(self, client: EngineClient, spec: LaunchSpec) -> list[str] | None:
        return None

    def refuse_runtime_adapters(self) -> AdapterError:
        if self.adapter_reserved:
            return AdapterError(
                f"{self.name} cannot load adapters while running: it serves those given at launch"
            )
        return AdapterError(f"{self.name} cannot serve LoRA adapters")

    def extra_env(self, spec: LaunchSpec) -> dict[str, str]:
        return {}

    # Variables that keep the engine's start-up off the network (update checks, usage
    # reports). The engine's own env may still set them otherwise.
    quiet_env: tuple[tuple[str, str], ...] = ()

    def offline_env(self, spec: LaunchSpec) -> dict[str, str]:
        """:attr:`quiet_env`, and for engines that take Hugging Face ids ``HF_HUB_OFFLINE=1``:
        CapyCTL fetched the weights (a bare ``OWNER/NAME`` too), so the engine never reaches
        the Hub itself, unless the engine's ``engine_downloads`` option leaves that to it."""
        env = dict(self.quiet_env)
        if self.name in HUB_NAME_KINDS and not engine_downloads(spec.options):
            env["HF_HUB_OFFLINE"] = "1"
        return env

    def cap_env(self, spec: LaunchSpec) -> dict[str, str]:
        """The variables that hold the engine to its claim, where it reads its cap there."""
        return {}

    def key_env(self, spec: LaunchSpec) -> dict[str, str]:
        """The variable the engine reads the launch key from, if it reads one."""
        return {}

    def key_files(self, spec: LaunchSpec) -> dict[Path, str]:
        """The file the engine reads the launch key from, if it reads one."""
        return {}

    def is_healthy(self, client: EngineClient, spec: LaunchSpec) -> bool:
        return client.healthy(self.health_path)

    def warm_up(self, client: EngineClient, spec: LaunchSpec) -> None:
        return None

    def refuse_park(self, mode: str) -> CannotParkError:
        if self.park_modes:
            return CannotParkError(f"{self.name} can park only {', '.join(self.park_modes)}")
        return CannotParkError(f"{self.name} cannot park; stop it to free its memory")

    def park(self, client: EngineClient, spec: LaunchSpec, mode: str) -> None:
        raise self.refuse_park(mode)

    def wake(self, client: EngineClient, spec: LaunchSpec, mode: str) -> None:
        raise self.refuse_park(mode)


def one_token_completion(client: EngineClient, spec: LaunchSpec) -> None:
    """The 1-token warm-up: loads kernels and graphs before the first real request."""
    client.request(
        "POST",
        "/v1/completions",
        json={"model": spec.served_name, "prompt": "Hi", "max_tokens": 1, "temperature": 0},
        timeout=300,
    )
