"""llama.cpp's ``llama-server``: ``/health`` is 503 while loading; no parking, so it is
stopped to make room and started again on its next request. The key is in
``LLAMA_API_KEY``, the variable of its ``--api-key`` option (``common/arg.cpp``).

Builds whose ``--help`` says ``--host`` binds a Unix socket when the address ends with
``.sock`` (llama.cpp since spring 2025: ``tools/server``'s ``AF_UNIX`` branch) are given
the socket's path as ``--host`` and no ``--port``; older ones listen on loopback."""

from __future__ import annotations

import math

from hostagent.kinds.base import (
    RESERVED_FLAGS,
    KindError,
    LaunchSpec,
    ProgramKind,
    loopback_flags,
)
from hostagent.kinds.client import EngineClient
from hostagent.versions import EngineFeatures, ProbeCommands

MIB = 1024**2
FIT_FLAGS = ("--fit", "-fit", "--fit-target", "-fitt")
UNIX_SOCKET = "unix-socket"
# common/arg.cpp's --host, as builds since spring 2025 word it: "ip address to listen, or
# bind to an UNIX socket if the address ends with .sock", later "IP addresses to listen on,
# comma-separated, or UNIX socket paths ending in .sock".
UNIX_SOCKET_HELP = r"(?is)\bunix\s+socket\b.{0,60}?\.sock\b"
SOCKET_SUFFIX = ".sock"


def fit_flags(spec: LaunchSpec) -> list[str]:
    """``--fit on --fit-target M0,M1,…``: llama-server sizes what the deployment's args
    leave unset (context, layers on the GPU) to leave ``M`` MiB free on each GPU; ``M`` is
    the GPU's free memory at launch less the claim, rounded up, so what it takes stays
    within the claim. Only where this build's ``--help`` lists ``--fit-target``, the launch
    has a claim and free figures, and the args set neither flag."""
    if spec.claim_bytes is None or not spec.gpu_memory:
        return []
    if spec.features is None or not spec.features.has("--fit-target"):
        return []
    if any(arg.split("=", 1)[0] in FIT_FLAGS for arg in spec.extra_args):
        return []
    margins = [max(0, math.ceil((free - spec.claim_bytes) / MIB)) for free, _ in spec.gpu_memory]
    return ["--fit", "on", "--fit-target", ",".join(str(m) for m in margins)]


def listen_flags(spec: LaunchSpec) -> list[str]:
    """``--host PATH.sock`` where the launch has a socket, else the loopback flags."""
    if spec.socket_path is None:
        return loopback_flags(spec)
    if not spec.socket_path.name.endswith(SOCKET_SUFFIX):
        raise KindError(f"llama-server's socket path must end with {SOCKET_SUFFIX}")
    return ["--host", str(spec.socket_path)]


class LlamaCppKind(ProgramKind):
    name = "llamacpp"
    description = "llama.cpp llama-server"
    reserved_flags = (*RESERVED_FLAGS, "--api-key-file", "-m", "--model", "--alias", "-a")
    adapter_reserved = ("--lora", "--lora-scaled", "--lora-init-without-apply")
    adapter_help_flag = "--lora-init-without-apply"
    # `version: N (hash)` on stderr; its --help lists every flag of this build.
    probes = ProbeCommands(help=["--help"], abilities=((UNIX_SOCKET, UNIX_SOCKET_HELP),))

    sizes_by_free_memory = True  # its --fit margin is counted from each GPU's free memory

    def engine_flags(self, spec: LaunchSpec) -> list[str]:
        return [
            "-m",
            spec.source,
            "--alias",
            spec.served_name,
            *listen_flags(spec),
            *fit_flags(spec),
        ]

    def socket_listening(self, features: EngineFeatures | None) -> bool:
        return features is not None and features.can(UNIX_SOCKET)

    def slot_flags(self, spec: LaunchSpec) -> list[str]:
        if len(spec.adapters) > spec.adapter_slots:
            raise KindError(
                f"{len(spec.adapters)} adapters given to a llamacpp launch with "
                f"{spec.adapter_slots} adapter slots"
            )
        flags = []
        for _, path in spec.adapters:
            flags += ["--lora", path]
        return [*flags, "--lora-init-without-apply"]

    def loaded_adapters(self, client: EngineClient, spec: LaunchSpec) -> list[str] | None:
        # All of the launch's adapters stay loaded; /lora-adapters lists them by index.
        listed = client.request("GET", "/lora-adapters").json()
        paths = [str(a.get("path")) for a in listed if isinstance(a, dict)]
        return [name for name, path in spec.adapters if path in paths]

    def key_env(self, spec: LaunchSpec) -> dict[str, str]:
        return {"LLAMA_API_KEY": spec.api_key}
