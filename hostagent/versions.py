"""What an installed engine program is: its version and the flags its ``--help`` lists.

CapyCTL asks the program itself, once (at ``capyctl engine add`` where the command runs
there, and on each host before its first launch there): the kind names the commands
(``tensorfold --version`` and ``tensorfold serve --help``, ``llama-server --version`` and
``--help``, ``vllm --version``...). They run without a shell, with a short timeout and a
minimal environment. A flag the program's help does not list is refused before a launch,
with one line, instead of an engine that exits at start.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from hostagent.errors import EngineError

# Long enough for a Python engine to import its CLI (vLLM's takes seconds), short enough
# that an add or a start never hangs on a program that waits for input.
DETECT_TIMEOUT_SECONDS = 20.0
_MINIMAL_NAMES = ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")
_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z0-9][\w-]*)")
_VERSION = re.compile(r"\d+(?:\.\d+)+[\w.+-]*")


class EngineFlagError(EngineError):
    """An engine argument names a flag the installed engine does not have."""


class EngineProbeError(EngineError):
    """The engine's own version or help command could not be run here."""


@dataclass(frozen=True)
class EngineFeatures:
    """What one run of the program's version and help commands said. ``flags`` is None
    where its kind does not read a help (then no flag is refused)."""

    version: str
    flags: frozenset[str] | None = None
    help_command: str = ""
    note: str = ""
    # What the help says the program can do beyond its flags (ProbeCommands.abilities).
    abilities: frozenset[str] = frozenset()

    def has(self, flag: str) -> bool:
        return self.flags is not None and flag in self.flags

    def can(self, ability: str) -> bool:
        return ability in self.abilities

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["flags"] = sorted(self.flags) if self.flags is not None else None
        data["abilities"] = sorted(self.abilities)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineFeatures:
        flags = data.get("flags")
        return cls(
            version=str(data.get("version", "")),
            flags=frozenset(flags) if flags is not None else None,
            help_command=str(data.get("help_command", "")),
            note=str(data.get("note", "")),
            abilities=frozenset(data.get("abilities") or ()),
        )


@dataclass(frozen=True)
class ProbeCommands:
    """A kind's questions to its program: the arguments after the command for its version,
    and for the help whose flags matter (None: no help read)."""

    version: list[str] | None = field(default_factory=lambda: ["--version"])
    help: list[str] | None = None
    # How long the help may take, where longer than the version (vLLM's imports all of
    # vLLM and PyTorch: many seconds); None: as long as the version.
    help_timeout: float | None = None
    # The name the help lists for a flag as given (vLLM reads ``--max_model_len`` as
    # ``--max-model-len``); None: as given.
    spelling: Callable[[str], str] | None = None
    # Abilities a flag's description tells of: (name, pattern searched in the help), as
    # llama-server's ``--host`` says it binds a Unix socket to a path ending in ``.sock``.
    abilities: tuple[tuple[str, str], ...] = ()


def minimal_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """What the version and help commands run with: a few of this process's variables and
    the engine's own env (no keys: nothing here is a launch)."""
    env = {name: os.environ[name] for name in _MINIMAL_NAMES if name in os.environ}
    env["LANG"] = "C"
    env.update(extra or {})
    return env


def _run(argv: list[str], env: dict[str, str], timeout: float) -> str:
    shown = " ".join(argv)
    try:
        done = subprocess.run(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError:
        raise EngineProbeError(f"{argv[0]}: no such program here") from None
    except PermissionError:
        raise EngineProbeError(f"{argv[0]}: not executable here") from None
    except subprocess.TimeoutExpired:
        raise EngineProbeError(f"{shown} did not answer within {timeout:.0f}s") from None
    # argparse prints --version to stdout, llama-server to stderr: read both.
    output = (done.stdout + b"\n" + done.stderr).decode("utf-8", "replace")
    if done.returncode != 0:
        last = next((ln for ln in reversed(output.splitlines()) if ln.strip()), "")
        raise EngineProbeError(f"{shown} exited {done.returncode}: {last.strip()[:200]}")
    return output


def parse_version(output: str) -> str:
    """The version in a program's ``--version`` output (``tensorfold 0.6.5``: ``0.6.5``;
    ``0.11.0``; llama-server's ``version: 6500 (a1b2c3d)``: ``6500 (a1b2c3d)``); else its
    first line."""
    lines = output.splitlines()
    for line in lines:
        if line.strip().lower().startswith("version:"):  # llama.cpp: the build says it
            return line.strip()[len("version:") :].strip()[:100]
    for line in lines:
        found = _VERSION.search(line)
        if found:
            return found.group(0)[:100]
    first = next((ln.strip() for ln in output.splitlines() if ln.strip()), "")
    return first[:100]


def parse_flags(output: str) -> frozenset[str]:
    """Every option a help text lists (``--name``, ``-m``; ``--[no-]x`` forms both)."""
    flags: set[str] = set()
    for line in output.splitlines():
        for flag in _FLAG.findall(line.replace("[no-]", "")):
            flags.add(flag)
        for flag in _FLAG.findall(line.replace("[no-]", "no-")):
            flags.add(flag)
    return frozenset(flags)


def detect(
    argv: list[str],
    probes: ProbeCommands,
    *,
    env: dict[str, str] | None = None,
    timeout: float = DETECT_TIMEOUT_SECONDS,
) -> EngineFeatures:
    """Run the program's version (and help) command; raise :class:`EngineProbeError`."""
    run_env = minimal_env(env)
    version = ""
    if probes.version is not None:
        version = parse_version(_run([*argv, *probes.version], run_env, timeout))
    if probes.help is None:
        return EngineFeatures(version=version)
    try:
        help_output = _run([*argv, *probes.help], run_env, probes.help_timeout or timeout)
    except EngineProbeError as exc:
        if not version:
            raise
        # The version stands; with no flags known, none is refused.
        return EngineFeatures(version=version, note=f"its flags are unknown: {exc}")
    if not version:  # SGLang's launch_server has no --version: its help is what it says
        version = "version not shown"
    return EngineFeatures(
        version=version,
        flags=parse_flags(help_output),
        help_command=" ".join(probes.help),
        abilities=frozenset(
            name for name, pattern in probes.abilities if re.search(pattern, help_output)
        ),
    )


def missing_flag(
    features: EngineFeatures, args: list[str], spelling: Callable[[str], str] | None = None
) -> str | None:
    """The first flag in ``args`` the program's help does not list, or None. A unique
    prefix of a listed long flag passes (argparse takes those); ``spelling`` gives the name
    the help lists for a flag as given."""
    if features.flags is None:
        return None
    for arg in args:
        if not arg.startswith("-") or arg == "-" or _is_number(arg):
            continue
        given = arg.split("=", 1)[0]
        name = spelling(given) if spelling is not None else given
        if name in features.flags:
            continue
        if name.startswith("--") and any(f.startswith(name) for f in features.flags):
            continue
        return given
    return None


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def check_flags(
    what: str,
    features: EngineFeatures,
    args: list[str],
    spelling: Callable[[str], str] | None = None,
) -> None:
    """Refuse ``args`` naming a flag the program lacks, with one line naming it."""
    flag = missing_flag(features, args, spelling)
    if flag is not None:
        raise EngineFlagError(
            f"{what} ({features.version or 'version unknown'}) has no {flag} flag: its "
            f"`{features.help_command or '--help'}` does not list it"
        )
