"""Memory figures of a deployment before they are measured (DESIGN §6).

Claim per GPU: explicit bytes; else an explicit fraction of the device; else the engine's
own fraction flag in its args (vLLM ``--gpu-memory-utilization``, SGLang
``--mem-fraction-static``); else what was measured at its last start; else vLLM's default
of 0.9 of the device; else the model files' size (with the adapters llama-server is
launched with) x 1.2 + 1 GiB. Weights copy: the larger
of the declared ``weights_bytes`` and the copy its last ``ram`` park measured, else the
weights' size at the source (safetensors/GGUF totals of the local or downloaded files),
else all it holds on its GPUs:
the copy is its weights, which never outgrow the GPU memory they sit in. Guessing lower
would let a first ``ram`` park promise less host RAM than its copy takes.
"""

from __future__ import annotations

from pathlib import Path

from capyctl.deployments.models import Adapter, Deployment
from hostagent.sources import classify, weights_size

GIB = 1024**3
ENGINE_RAM_ESTIMATE = 512 * 1024**2  # host RAM of an engine process before it is measured
_FRACTION_FLAGS = {"vllm": "--gpu-memory-utilization", "sglang": "--mem-fraction-static"}
_DEFAULT_FRACTION = {"vllm": 0.9}


def files_size(deployment: Deployment) -> int | None:
    """Bytes of the model's weights: as measured when its source was last fetched (the
    downloaded or local files' safetensors/GGUF total), else read from a local path on
    this machine, else None."""
    if deployment.source_bytes:
        return int(deployment.source_bytes)
    if classify(deployment.source) != "local":
        return None
    return weights_size(Path(deployment.source).expanduser())


def _args_fraction(deployment: Deployment) -> float | None:
    flag = _FRACTION_FLAGS.get(deployment.engine.kind)
    if flag is None:
        return None
    args = list(deployment.engine_args)
    for i, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        if name != flag:
            continue
        text = value if sep else (args[i + 1] if i + 1 < len(args) else "")
        try:
            return float(text)
        except ValueError:
            return None
    return None


def claim_per_gpu(  # noqa: PLR0911 - the order of DESIGN §6, one answer per rule
    deployment: Deployment, device_total: int
) -> int:
    if deployment.gpus == 0:
        return 0
    if deployment.gpu_memory_bytes is not None:
        return int(deployment.gpu_memory_bytes)
    if deployment.gpu_memory_fraction is not None:
        return int(device_total * deployment.gpu_memory_fraction)
    fraction = _args_fraction(deployment)
    if fraction is not None:
        return int(device_total * fraction)
    if deployment.measured_gpu_bytes is not None:
        return int(deployment.measured_gpu_bytes)
    default = _DEFAULT_FRACTION.get(deployment.engine.kind)
    if default is not None:
        return int(device_total * default)
    size = (files_size(deployment) or 0) + launch_adapters_size(deployment)
    return min(int(size * 1.2) + GIB, device_total)


def launch_adapters_size(deployment: Deployment) -> int:
    """Bytes of the adapters an engine that takes them at launch holds beside its weights
    (llama-server loads its ``--lora`` files at start): those it is launched with, as
    fetched (an adapter not fetched yet counts for nothing until it is)."""
    if deployment.engine.kind != "llamacpp" or deployment.adapter_slots <= 0:
        return 0
    base = deployment.replica_of_id or deployment.pk
    sizes = Adapter.objects.filter(base_id=base).order_by("created_at", "pk")
    chosen = sizes.values_list("source_bytes", flat=True)[: deployment.adapter_slots]
    return sum(int(size or 0) for size in chosen)


def memory_fraction(deployment: Deployment, device_total: int) -> float | None:
    """The share of each GPU to tell the engine it may take (None: its own args decide)."""
    if deployment.gpus == 0 or device_total <= 0 or _args_fraction(deployment) is not None:
        return None
    return min(claim_per_gpu(deployment, device_total) / device_total, 1.0)


# What an engine's start may be measured holding on a GPU beyond its claim: the larger of
# a share of the claim and a fixed slack (allocator rounding, a CUDA context the engine's
# own cap leaves out). Past it, the start is refused or the claim raised (``over_claim``).
OVER_CLAIM_SHARE = 0.05
OVER_CLAIM_SLACK_BYTES = 512 * 1024**2


def over_claim_tolerance(claim: int) -> int:
    return max(int(claim * OVER_CLAIM_SHARE), OVER_CLAIM_SLACK_BYTES)


def over_claim(figures: dict[str, int], pools: list[str], claim: int) -> dict[str, int]:
    """The GPU pools whose measured figure is past the claim and its tolerance (pool ->
    bytes). A figure the probe could not give is the claim itself, so it is never over."""
    bound = claim + over_claim_tolerance(claim)
    return {pool: figures[pool] for pool in pools if figures.get(pool, 0) > bound}


def weights_bytes(deployment: Deployment, gpu_held: int) -> int:
    """The weights copy a ``ram`` park keeps in host RAM, as a park promises it: the larger
    of the declared ``weights_bytes`` and the copy its last ``ram`` park was measured at (a
    declared size smaller than the real copy is corrected by the first park); else the
    weights' size at the source; else ``gpu_held``, what the deployment holds on all its
    GPUs now, the bound when nothing better is known."""
    known = deployment.weights_copy_bytes
    if known is not None:
        return known
    size = files_size(deployment)
    return size if size else gpu_held
