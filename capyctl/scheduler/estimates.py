"""Memory figures of a deployment before they are measured (DESIGN §6).

Claim per GPU: explicit bytes; else an explicit fraction of the device; else the engine's
own fraction flag in its args (vLLM ``--gpu-memory-utilization``, SGLang
``--mem-fraction-static``); else what was measured at its last start; else vLLM's default
of 0.9 of the device; else the model files' size x 1.2 + 1 GiB. Weights copy: explicit
``weights_bytes``, else the measured figure, else the files' size on disk, else half the
claim.
"""

from __future__ import annotations

from pathlib import Path

from capyctl.deployments.models import Deployment

GIB = 1024**3
ENGINE_RAM_ESTIMATE = 512 * 1024**2  # host RAM of an engine process before it is measured
_FRACTION_FLAGS = {"vllm": "--gpu-memory-utilization", "sglang": "--mem-fraction-static"}
_DEFAULT_FRACTION = {"vllm": 0.9}


def files_size(source: str) -> int | None:
    """Bytes of the model files at a local path (a file or a directory), or None."""
    path = Path(source)
    try:
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:
        return None
    return None


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
    size = files_size(deployment.source) or 0
    return min(int(size * 1.2) + GIB, device_total)


def memory_fraction(deployment: Deployment, device_total: int) -> float | None:
    """The share of each GPU to tell the engine it may take (None: its own args decide)."""
    if deployment.gpus == 0 or device_total <= 0 or _args_fraction(deployment) is not None:
        return None
    return min(claim_per_gpu(deployment, device_total) / device_total, 1.0)


def weights_bytes(deployment: Deployment, claim: int) -> int:
    if deployment.weights_bytes is not None:
        return int(deployment.weights_bytes)
    if deployment.measured_weights_bytes is not None:
        return int(deployment.measured_weights_bytes)
    size = files_size(deployment.source)
    return size if size else claim // 2
