"""The command lines of the real engines, as the simulated ones accept them."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

from hostagent.sim.cuda import check_device
from hostagent.units import parse_size

KINDS = ("vllm", "sglang", "llamacpp", "tensorfold")


@dataclass(frozen=True)
class SimOptions:
    kind: str
    source: str
    served_name: str
    host: str
    port: int
    api_keys: frozenset[str]  # empty: every request is let in
    sleep_mode: bool  # vLLM --enable-sleep-mode / SGLang --enable-memory-saver
    cpu_backup: bool  # SGLang --enable-weights-cpu-backup
    memory_fraction: float | None


@dataclass(frozen=True)
class Knobs:
    load_seconds: float
    load_gate: Path | None
    sleep_seconds: float
    wake_seconds: float
    tokens_per_second: float
    completion_tokens: int
    gpu_bytes: int | None
    weights_bytes: int | None
    residual_bytes: int
    crash_after: int | None
    hang_on_wake: bool
    wake_gate: Path | None
    keep_memory: bool
    die_mid_stream: bool
    device: str = "sim"  # "cuda": real allocations behind the figures (hostagent.sim.cuda)
    # A deep park's time (None: sleep_seconds), and a deep wake's in all (None: each wake
    # call takes wake_seconds, as for a ram one).
    deep_sleep_seconds: float | None = None
    deep_wake_seconds: float | None = None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_options(argv: list[str]) -> SimOptions:
    if not argv or argv[0] not in KINDS:
        raise SystemExit(f"usage: python -m hostagent.sim {{{','.join(KINDS)}}} ARGS")
    kind, rest = argv[0], argv[1:]
    parser = _Parser(prog=f"hostagent.sim {kind}")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", action="append", default=[])
    if kind == "vllm":
        parser.add_argument("serve", choices=["serve"])
        parser.add_argument("source")
        parser.add_argument("--served-model-name")
        parser.add_argument("--enable-sleep-mode", action="store_true")
        parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    elif kind == "sglang":
        parser.add_argument("--model-path", dest="source", required=True)
        parser.add_argument("--served-model-name")
        parser.add_argument("--enable-memory-saver", action="store_true")
        parser.add_argument("--enable-weights-cpu-backup", action="store_true")
        parser.add_argument("--mem-fraction-static", type=float, default=0.88)
        parser.add_argument("--config")
    elif kind == "llamacpp":
        parser.add_argument("-m", "--model", dest="source", required=True)
        parser.add_argument("-a", "--alias", dest="served_model_name")
        parser.add_argument("--api-key-file")
    else:  # tensorfold
        parser.add_argument("serve", choices=["serve"])
        parser.add_argument("source")
        parser.add_argument("--name", dest="served_model_name")
        parser.add_argument("--api-key-file")
    args, _unknown = parser.parse_known_args(rest)  # the real engines take many more flags
    fraction = getattr(args, "gpu_memory_utilization", None) or getattr(
        args, "mem_fraction_static", None
    )
    return SimOptions(
        kind=kind,
        source=args.source,
        served_name=args.served_model_name or args.source,
        host=args.host,
        port=args.port,
        api_keys=frozenset(_api_keys(kind, args)),
        sleep_mode=bool(
            getattr(args, "enable_sleep_mode", False) or getattr(args, "enable_memory_saver", False)
        ),
        cpu_backup=bool(getattr(args, "enable_weights_cpu_backup", False)),
        memory_fraction=fraction,
    )


def _key_lines(path: str) -> list[str]:
    """The keys of a key file, one a line; blank lines and ``#`` comments skipped (a
    TensorFold ``label: key`` line gives its key)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    keys = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return [key.split(": ", 1)[-1] for key in keys]


def _config_key(path: str) -> list[str]:
    """SGLang's ``--config``: a .yaml file of options; CapyCTL writes it as JSON, which
    YAML reads too."""
    if Path(path).suffix.lower() not in (".yaml", ".yml"):
        raise SystemExit(f"Config file must be YAML format, got: {Path(path).suffix}")
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    key = data.get("api-key", data.get("api_key"))
    return [str(key)] if key else []


def _api_keys(kind: str, args: argparse.Namespace) -> list[str]:
    """The keys the real engine would take, from where it takes them: vLLM ``--api-key``
    else ``VLLM_API_KEY``; SGLang ``--api-key`` else its ``--config`` file; llama-server
    ``--api-key`` (else ``LLAMA_API_KEY``) and ``--api-key-file`` (else
    ``LLAMA_ARG_API_KEY_FILE``); TensorFold all of ``--api-key``, ``--api-key-file`` and
    ``TENSORFOLD_API_KEY``."""
    given: list[str] = list(args.api_key)
    env = os.environ
    if kind == "vllm":
        return given or [k for k in [env.get("VLLM_API_KEY", "")] if k]
    if kind == "sglang":
        return given or (_config_key(args.config) if args.config else [])
    if kind == "llamacpp":
        keys = given or [k for k in [env.get("LLAMA_API_KEY", "")] if k]
        key_file = args.api_key_file or env.get("LLAMA_ARG_API_KEY_FILE", "")
        return keys + (_key_lines(key_file) if key_file else [])
    keys = given + (_key_lines(args.api_key_file) if args.api_key_file else [])
    return keys + [k for k in [env.get("TENSORFOLD_API_KEY", "")] if k]


def _float(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    return float(value) if value else default


def _optional_float(name: str) -> float | None:
    value = os.environ.get(name, "")
    return float(value) if value else None


def _size(name: str) -> int | None:
    value = os.environ.get(name, "")
    return parse_size(value) if value else None


def _path(name: str) -> Path | None:
    value = os.environ.get(name, "")
    return Path(value) if value else None


def read_knobs() -> Knobs:
    crash = os.environ.get("CAPYCTL_SIM_CRASH_AFTER", "")
    return Knobs(
        load_seconds=_float("CAPYCTL_SIM_LOAD_SECONDS", 0.0),
        load_gate=_path("CAPYCTL_SIM_LOAD_GATE"),
        sleep_seconds=_float("CAPYCTL_SIM_SLEEP_SECONDS", 0.0),
        wake_seconds=_float("CAPYCTL_SIM_WAKE_SECONDS", 0.0),
        tokens_per_second=_float("CAPYCTL_SIM_TOKENS_PER_SECOND", 0.0),
        completion_tokens=int(_float("CAPYCTL_SIM_COMPLETION_TOKENS", 8)),
        gpu_bytes=_size("CAPYCTL_SIM_GPU_BYTES"),
        weights_bytes=_size("CAPYCTL_SIM_WEIGHTS_BYTES"),
        residual_bytes=_size("CAPYCTL_SIM_RESIDUAL_BYTES") or 256 * 1024**2,
        crash_after=int(crash) if crash else None,
        hang_on_wake=os.environ.get("CAPYCTL_SIM_HANG_ON_WAKE") == "1",
        wake_gate=_path("CAPYCTL_SIM_WAKE_GATE"),
        keep_memory=os.environ.get("CAPYCTL_SIM_KEEP_MEMORY") == "1",
        die_mid_stream=os.environ.get("CAPYCTL_SIM_DIE_MID_STREAM") == "1",
        device=check_device(os.environ.get("CAPYCTL_SIM_DEVICE", "")),
        deep_sleep_seconds=_optional_float("CAPYCTL_SIM_DEEP_SLEEP_SECONDS"),
        deep_wake_seconds=_optional_float("CAPYCTL_SIM_DEEP_WAKE_SECONDS"),
    )
