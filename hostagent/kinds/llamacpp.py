"""llama.cpp's ``llama-server``: ``/health`` is 503 while loading; no parking, so it is
stopped to make room and started again on its next request. The key is in
``LLAMA_API_KEY``, the variable of its ``--api-key`` option (``common/arg.cpp``)."""

from __future__ import annotations

import math

from hostagent.kinds.base import RESERVED_FLAGS, LaunchSpec, ProgramKind, loopback_flags
from hostagent.versions import ProbeCommands

MIB = 1024**2
FIT_FLAGS = ("--fit", "-fit", "--fit-target", "-fitt")


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


class LlamaCppKind(ProgramKind):
    name = "llamacpp"
    description = "llama.cpp llama-server"
    reserved_flags = (*RESERVED_FLAGS, "--api-key-file", "-m", "--model", "--alias", "-a")
    # `version: N (hash)` on stderr; its --help lists every flag of this build.
    probes = ProbeCommands(help=["--help"])

    sizes_by_free_memory = True  # its --fit margin is counted from each GPU's free memory

    def engine_flags(self, spec: LaunchSpec) -> list[str]:
        return [
            "-m",
            spec.source,
            "--alias",
            spec.served_name,
            *loopback_flags(spec),
            *fit_flags(spec),
        ]

    def key_env(self, spec: LaunchSpec) -> dict[str, str]:
        return {"LLAMA_API_KEY": spec.api_key}
