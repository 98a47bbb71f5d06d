"""What a simulated engine says of itself: ``--version`` and ``--help`` as the real programs
answer them, for the simulated version ``CAPYCTL_SIM_VERSION`` (else each kind's default).

The real outputs: ``vllm --version`` prints the bare version (``0.33.0``); SGLang's
``launch_server`` has no ``--version`` (its argparse refuses it) and ``--help`` lists its
flags; ``llama-server --version`` prints ``version: N (hash)`` and ``built with ...`` to
stderr; ``tensorfold --version`` prints ``tensorfold X.Y.Z`` and ``tensorfold serve --help``
its serve flags. TensorFold's keys and its prototype sleep API came in later releases: the
simulated TensorFold has ``--api-key``/``--api-key-file`` from :data:`TENSORFOLD_KEYS_FROM`
and ``--enable-sleep-mode`` from :data:`TENSORFOLD_SLEEP_FROM`, and refuses them before
(argparse's exit 2), as an older real one does.
"""

from __future__ import annotations

import os
import re
import sys

from hostagent.sim.flags import table

VERSION_ENV = "CAPYCTL_SIM_VERSION"
# "1": the simulated build predates its engine's Unix socket support (vLLM's --uds, the
# "bind to an UNIX socket" of llama-server's --host): its help does not say it, and its
# parser refuses --uds.
NO_SOCKET_ENV = "CAPYCTL_SIM_NO_SOCKET"
# llama-server's --host, as common/arg.cpp describes it in builds that bind Unix sockets.
LLAMA_HOST_HELP = (
    "ip address to listen, or bind to an UNIX socket if the address ends with .sock "
    "(default: 127.0.0.1)"
)
DEFAULT_VERSIONS = {
    "vllm": "0.33.0",  # the releases whose flags hostagent.sim.flags lists
    "sglang": "0.5.23",
    "llamacpp": "6500 (1a2b3c4d)",
    "tensorfold": "0.6.5",
}
TENSORFOLD_KEYS_FROM = (0, 6, 0)
TENSORFOLD_SLEEP_FROM = (0, 6, 4)
TENSORFOLD_KEY_FLAGS = ("--api-key", "--api-key-file")
TENSORFOLD_SLEEP_FLAGS = (
    "--enable-sleep-mode",
    "--sleep-token-env",
    "--sleep-timeout",
    "--sleep-cache-dir",
)


def sim_version(kind: str) -> str:
    return os.environ.get(VERSION_ENV, "") or DEFAULT_VERSIONS[kind]


def _release(version: str) -> tuple[int, ...]:
    """``0.6.5`` as (0, 6, 5); parts that are not numbers end it."""
    parts: list[int] = []
    for part in version.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group(0)))
    return tuple(parts)


def socket_support() -> bool:
    """Whether the simulated build can listen on a Unix socket (see NO_SOCKET_ENV)."""
    return os.environ.get(NO_SOCKET_ENV, "") != "1"


def lacking_flags(kind: str) -> tuple[str, ...]:
    """The modelled flags the simulated version of ``kind`` does not have yet."""
    if kind != "tensorfold":
        return () if socket_support() else ("--uds",)
    release = _release(sim_version(kind))
    lacking: tuple[str, ...] = ()
    if release < TENSORFOLD_KEYS_FROM:
        lacking += TENSORFOLD_KEY_FLAGS
    if release < TENSORFOLD_SLEEP_FROM:
        lacking += TENSORFOLD_SLEEP_FLAGS
    return lacking


def has_flag(kind: str, flag: str) -> bool:
    return flag not in lacking_flags(kind)


def _help_text(kind: str) -> str:
    """A help listing the real program's flags (:mod:`hostagent.sim.flags`), less those the
    simulated version lacks."""
    lacking = lacking_flags(kind)
    flags = sorted(flag for flag in table(kind).items() if flag[0] not in lacking)
    prog = {"tensorfold": "tensorfold serve", "llamacpp": "llama-server"}.get(kind, kind)
    lines = [f"usage: {prog} [-h] [options]", "", "options:", "  -h, --help  show this help"]
    for flag, arity in flags:
        if flag in ("-h", "--help"):
            continue
        # argparse's BooleanOptionalAction lists both forms: ``--x, --no-x``.
        line = f"  {flag}, --no-{flag[2:]}" if arity == "!" else f"  {flag}"
        if kind == "llamacpp" and flag == "--host" and socket_support():
            line += f" HOST  {LLAMA_HOST_HELP}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def answer_identity(kind: str, rest: list[str]) -> None:
    """Answer ``--version`` or ``--help`` like the real program and exit, or refuse a flag
    the simulated version lacks like its parser does (exit 2); else return."""
    # vLLM and TensorFold take it before their subcommand; SGLang has none (its parser
    # refuses it); llama-server anywhere.
    asked = rest[:1] if kind in ("tensorfold", "vllm") else rest if kind == "llamacpp" else []
    if "--version" in asked:
        version = sim_version(kind)
        if kind == "llamacpp":  # llama-server: to stderr, with its build line
            sys.stderr.write(f"version: {version}\nbuilt with cc for x86_64-linux-gnu\n")
        elif kind == "tensorfold":
            sys.stdout.write(f"tensorfold {version}\n")
        else:
            sys.stdout.write(f"{version}\n")
        raise SystemExit(0)
    # vLLM's ``serve --help`` lists its config groups only; ``--help=all`` every flag.
    searched = kind == "vllm" and any(arg.startswith("--help=") for arg in rest)
    if "--help" in rest or "-h" in rest or searched:
        sys.stdout.write(_help_text(kind))
        raise SystemExit(0)
    lacking = [arg for arg in rest if arg.split("=", 1)[0] in lacking_flags(kind)]
    if lacking:
        prog = "tensorfold" if kind == "tensorfold" else kind
        sys.stderr.write(f"{prog}: error: unrecognized arguments: {' '.join(lacking)}\n")
        raise SystemExit(2)
