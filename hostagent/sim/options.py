"""The command lines of the real engines, as the simulated ones accept them."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hostagent.sim import flags
from hostagent.sim.cuda import check_device
from hostagent.sim.identity import answer_identity, socket_support
from hostagent.units import parse_size

KINDS = ("vllm", "sglang", "llamacpp", "tensorfold")


@dataclass(frozen=True)
class SimOptions:
    kind: str
    source: str
    served_name: str
    host: str
    port: int
    # Where it listens instead of host:port: vLLM's --uds, llama-server's --host PATH.sock.
    socket_path: str | None
    api_keys: frozenset[str]  # empty: every request is let in
    sleep_mode: bool  # vLLM --enable-sleep-mode / SGLang --enable-memory-saver
    cpu_backup: bool  # SGLang --enable-weights-cpu-backup
    memory_fraction: float | None
    # vLLM's and SGLang's --allowed-media-domains (empty: media fetched from any host)
    media_domains: tuple[str, ...] = ()
    # LoRA (hostagent/sim/adapters.py): vLLM/SGLang --enable-lora; the GPU slots (vLLM
    # --max-loras, SGLang --max-loras-per-batch); the largest rank (0: none given); SGLang's
    # --lora-target-modules; llama-server's --lora files, in order, and whether they start
    # at scale 0 (--lora-init-without-apply).
    lora: bool = False
    lora_slots: int = 0
    lora_max_rank: int = 0
    lora_target_modules: tuple[str, ...] = ()
    lora_files: tuple[str, ...] = ()
    lora_init_without_apply: bool = False


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
    # TensorFold's own memory settings as its environment gives them (hostagent.sim.memory
    # reads them as TensorFold does): the cap on its budget, and its reserve's GiB.
    memory_limit_gb: str | None = None  # TENSORFOLD_CUDA_MEMORY_LIMIT_GB
    memory_reserve_gib: str | None = None  # TENSORFOLD_MEMORY_RESERVE_GIB
    # Saturation (hostagent.sim.load): requests generated at once (0: no limit), a prefix
    # cache's tokens (0: none) and the prefill pace of what it misses (0: no prefill time),
    # and a gate that holds each running chat or completion request until its file exists.
    max_concurrency: int = 0
    prefix_cache_tokens: int = 0
    prefill_tokens_per_second: float = 0.0
    request_gate: Path | None = None
    # LoRA: how long an adapter's load takes, and the GPU bytes each adapter slot reserves
    # at start (vLLM and SGLang allocate their slots' buffers as they load the model).
    lora_load_seconds: float = 0.05
    lora_slot_bytes: int = 64 * 1024**2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


# What each real program calls itself in its usage errors.
_PROGS = {"vllm": "vllm serve", "sglang": "sglang serve", "tensorfold": "tensorfold serve"}
# The flags the simulators read, each as the real parser defines it; every other flag of
# the real engine (hostagent.sim.flags) is taken and ignored.
_READ: dict[str, list[tuple[tuple[str, ...], dict[str, object]]]] = {
    "vllm": [  # vllm/entrypoints/common/cli_args.py, vllm/engine/arg_utils.py
        (("--host",), {"default": "127.0.0.1"}),
        (("--port",), {"type": int, "default": 8000}),
        (("--uds",), {}),  # FrontendArgs.uds: "If set, host and port arguments are ignored."
        (("--api-key",), {"nargs": "+", "default": []}),
        (("--served-model-name",), {"nargs": "+"}),
        (("--model",), {"dest": "model"}),
        (("--enable-sleep-mode", "--no-enable-sleep-mode", "--disable-sleep-mode"), {}),
        (("--gpu-memory-utilization",), {"type": float, "default": 0.9}),  # 0.92 from 0.12
        (("--allowed-media-domains",), {"nargs": "+", "default": []}),
        (("--enable-lora", "--no-enable-lora", "--disable-lora"), {}),
        (("--max-loras",), {"type": int, "default": 1}),  # vllm/config/lora.py
        (("--max-lora-rank",), {"type": int, "default": 16}),
    ],
    "sglang": [  # python/sglang/srt/server_args.py and its arg_groups/fields
        (("--model-path", "--model"), {"dest": "source", "required": True}),
        (("--host",), {"default": "127.0.0.1"}),
        (("--port",), {"type": int, "default": 30000}),
        (("--api-key",), {"action": "append", "default": []}),
        (("--served-model-name",), {}),
        (("--enable-memory-saver",), {"action": "store_true"}),
        (("--enable-weights-cpu-backup",), {"action": "store_true"}),
        (("--mem-fraction-static",), {"type": float, "default": 0.88}),
        (("--config",), {}),
        (("--allowed-media-domains",), {"nargs": "+", "default": []}),
        (("--enable-lora",), {"action": "store_true"}),
        (("--max-loras-per-batch",), {"type": int, "default": 8}),
        (("--max-lora-rank",), {"type": int}),
        (("--lora-target-modules",), {"nargs": "*"}),
        (("--lora-paths",), {"nargs": "*"}),
    ],
    "tensorfold": [  # src/tensorfold/cli_args.py
        (("--host",), {"default": "127.0.0.1"}),
        (("--port",), {"type": int, "default": 8080}),
        (("--name",), {"dest": "served_model_name"}),
        (("--api-key",), {"action": "append", "default": []}),
        (("--api-key-file",), {}),
        (("--enable-sleep-mode",), {"action": "store_true"}),
    ],
}


def parse_options(argv: list[str]) -> SimOptions:
    if not argv or argv[0] not in KINDS:
        raise SystemExit(f"usage: python -m hostagent.sim {{{','.join(KINDS)}}} ARGS")
    kind, rest = argv[0], argv[1:]
    answer_identity(kind, rest)  # --version, --help, flags this version lacks (identity.py)
    args = _parse_llamacpp(rest) if kind == "llamacpp" else _parse_argparse(kind, rest)
    fraction = getattr(args, "gpu_memory_utilization", None) or getattr(
        args, "mem_fraction_static", None
    )
    return SimOptions(
        kind=kind,
        source=args.source,
        served_name=args.served_model_name or args.source,
        host=args.host,
        port=args.port,
        socket_path=_socket_path(kind, args),
        api_keys=frozenset(_api_keys(kind, args)),
        sleep_mode=bool(
            getattr(args, "enable_sleep_mode", False) or getattr(args, "enable_memory_saver", False)
        ),
        cpu_backup=bool(getattr(args, "enable_weights_cpu_backup", False)),
        memory_fraction=fraction,
        media_domains=tuple(getattr(args, "allowed_media_domains", None) or ()),
        **_lora_options(kind, args),
    )


def _lora_options(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """The LoRA settings as each engine reads them. SGLang turns LoRA on for
    ``--lora-paths`` too, and refuses to start with neither those nor both a rank and
    target modules (server_args.py's check, an assertion: the process exits)."""
    if kind == "llamacpp":
        files = tuple(args.lora)
        return {"lora": bool(files), "lora_slots": len(files), "lora_files": files,
                "lora_init_without_apply": args.lora_init_without_apply}  # fmt: skip
    if kind == "vllm":
        enabled = bool(args.enable_lora)
        return {"lora": enabled, "lora_slots": args.max_loras if enabled else 0,
                "lora_max_rank": args.max_lora_rank}  # fmt: skip
    if kind != "sglang":
        return {}
    enabled = bool(args.enable_lora or args.lora_paths)
    if enabled and not args.lora_paths and not (args.max_lora_rank and args.lora_target_modules):
        raise SystemExit(
            "AssertionError: When no initial --lora-paths is provided, you need to specify "
            "both --max-lora-rank and --lora-target-modules for LoRA initialization."
        )
    return {"lora": enabled, "lora_slots": args.max_loras_per_batch if enabled else 0,
            "lora_max_rank": args.max_lora_rank or 0,
            "lora_target_modules": tuple(args.lora_target_modules or ())}  # fmt: skip


def _socket_path(kind: str, args: argparse.Namespace) -> str | None:
    """vLLM's ``--uds`` (vllm/entrypoints/openai/api_server.py setup_server: the socket,
    and no TCP port); llama-server's ``--host`` ending in ``.sock`` where the build binds
    Unix sockets (tools/server: ``AF_UNIX``, no port); else None."""
    if kind == "vllm":
        return getattr(args, "uds", None)
    if kind == "llamacpp" and args.host.endswith(".sock") and socket_support():
        return str(args.host)
    return None


class _EnableDisable(argparse.Action):
    """vLLM's EnableDisableAction: ``--x`` sets, ``--no-x`` (and ``--disable-`` for
    ``--enable-``) clears (vllm/utils/argparse_utils.py)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=False)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:  # fmt: skip
        cleared = option_string is not None and option_string.startswith(("--no-", "--disable-"))
        setattr(namespace, self.dest, not cleared)


_NARGS = {"=": None, "?": "?", "+": "+", "*": "*"}


def _engine_parser(kind: str) -> argparse.ArgumentParser:
    """The real engine's parser: the flags read here, then every other flag of its table
    with its arity (argparse's prefix matching, allow_abbrev, as in the real ones)."""
    parser = _Parser(prog=_PROGS[kind], add_help=False)
    if kind in ("vllm", "tensorfold"):
        parser.add_argument("source", nargs="?" if kind == "vllm" else None)
    for names, options in _READ[kind]:
        if kind == "vllm" and names[0] in ("--enable-sleep-mode", "--enable-lora"):
            dest = names[0].removeprefix("--").replace("-", "_")
            parser.add_argument(*names, dest=dest, action=_EnableDisable)
        else:
            parser.add_argument(*names, **options)  # type: ignore[arg-type]
    taken = set(parser._option_string_actions)
    for name, arity in flags.table(kind).items():
        if name in taken:
            continue
        dest = f"other_{len(taken)}"  # never read: only the command line's shape matters
        if arity == "!":
            spelled = [name, f"--no-{name[2:]}"]
            for prefix, inverse in (("--enable-", "--disable-"), ("--disable-", "--enable-")):
                if kind == "vllm" and name.startswith(prefix):
                    spelled.append(inverse + name.removeprefix(prefix))
            spelled = [n for n in spelled if n not in taken]
            parser.add_argument(*spelled, dest=dest, action=_EnableDisable)
        elif arity == "":
            parser.add_argument(name, dest=dest, action="store_true")
        else:
            nargs = 2 if arity == "=2" else _NARGS[arity]
            parser.add_argument(name, dest=dest, nargs=nargs)
        taken.update(parser._option_string_actions)
    return parser


def _vllm_args(rest: list[str]) -> list[str]:
    """vLLM's FlexibleArgumentParser rewriting (vllm/utils/argparse_utils.py): ``serve``
    first, ``_`` for ``-`` in a ``--`` name, ``-O3`` as ``--optimization-level 3``, and a
    JSON flag's ``--name.key value`` parts (taken, not read); ``--model X`` as the model."""
    if not rest or rest[0] != "serve":
        raise SystemExit("usage: vllm serve [model_tag] [options]")
    out: list[str] = []
    items = iter(rest[1:])
    for given in items:
        arg = given
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            head, dot, tail = key.partition(".")
            arg = head.replace("_", "-") + dot + tail + eq + value
            if dot:
                if not eq:
                    next(items, None)
                arg = head.replace("_", "-") + "={}"
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2:3] == "=" else arg[2:]]
            continue
        elif arg == "-O":
            arg = "--optimization-level"
        out.append(arg)
    return out


def _parse_argparse(kind: str, rest: list[str]) -> argparse.Namespace:
    parser = _engine_parser(kind)
    if kind == "vllm":
        rest = _vllm_args(rest)
    elif kind == "tensorfold":
        if not rest or rest[0] != "serve":
            raise SystemExit(
                "usage: tensorfold [-h] [--version] {serve,pull,models,update,info} ..."
            )
        rest = rest[1:]
    args = parser.parse_args(rest)
    if kind == "vllm":
        args.source = args.source or args.model
        if not args.source:
            parser.error("the following arguments are required: model_tag")
        names = args.served_model_name or []
        args.served_model_name = names[0] if names else None
    return args


def _parse_llamacpp(rest: list[str]) -> argparse.Namespace:
    """llama-server's own parser (common/arg.cpp, common_params_parse_ex): each argument
    matched whole (``_`` read as ``-`` in a ``--`` one), values in the next arguments; an
    unknown one is ``error: invalid argument: X`` on stderr and exit 1."""
    known = flags.table("llamacpp")
    read = {"-m": "source", "--model": "source", "-a": "served_model_name",
            "--alias": "served_model_name", "--host": "host", "--port": "port",
            "--api-key": "api_key", "--api-key-file": "api_key_file"}  # fmt: skip
    values: dict[str, str] = {}
    loras: list[str] = []  # --lora is repeatable: each adds a file, in order
    switches: set[str] = set()
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg.startswith("--"):
            arg = arg.replace("_", "-")
        if arg not in known:
            raise SystemExit(f"error: invalid argument: {arg}")
        count = {"": 0, "=": 1, "=2": 2}[known[arg]]
        if i + count >= len(rest):
            raise SystemExit(f'error while handling argument "{arg}": expected value for argument')
        if arg in read:
            values[read[arg]] = rest[i + 1]
        elif arg == "--lora":
            loras.append(rest[i + 1])
        elif count == 0:
            switches.add(arg)
        i += count + 1
    if "port" in values and not values["port"].lstrip("-").isdigit():
        raise SystemExit('error while handling argument "--port": stoi')
    return argparse.Namespace(
        source=values.get("source", "models/7B/ggml-model-f16.gguf"),
        served_model_name=values.get("served_model_name"),
        host=values.get("host", "127.0.0.1"),
        port=int(values.get("port", "8080")),
        api_key=values["api_key"].split(",") if "api_key" in values else [],
        api_key_file=values.get("api_key_file"),
        lora=loras,
        lora_init_without_apply="--lora-init-without-apply" in switches,
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
        memory_limit_gb=os.environ.get("TENSORFOLD_CUDA_MEMORY_LIMIT_GB"),
        memory_reserve_gib=os.environ.get("TENSORFOLD_MEMORY_RESERVE_GIB", "").strip() or None,
        max_concurrency=int(_float("CAPYCTL_SIM_MAX_CONCURRENCY", 0)),
        prefix_cache_tokens=int(_float("CAPYCTL_SIM_PREFIX_CACHE", 0)),
        prefill_tokens_per_second=_float("CAPYCTL_SIM_PREFILL_TOKENS_PER_SECOND", 0.0),
        request_gate=_path("CAPYCTL_SIM_REQUEST_GATE"),
        lora_load_seconds=_float("CAPYCTL_SIM_LORA_LOAD_SECONDS", 0.05),
        lora_slot_bytes=_size("CAPYCTL_SIM_LORA_SLOT_BYTES") or 64 * 1024**2,
    )
