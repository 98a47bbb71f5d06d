"""``capyctl service print KIND``: a hardened systemd unit that runs ``capyctl start KIND``.

Django-free, like ``start host``: a GPU machine that runs only the host agent can print its
unit. A unit is a command line run as a service user, so every value that goes into it
passes an allowlist first (:func:`unit_path`, :func:`unit_user`, :func:`unit_listen`), and
``%`` (systemd's specifier sign) is written ``%%``. Secrets never go on ``ExecStart``:
they live in the ``EnvironmentFile``, which systemd reads as root before it drops to the
service user, so it can stay ``root:root 0600``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

KINDS = ("standalone", "server", "worker", "host")
GPU_KINDS = frozenset({"standalone", "host"})  # they run engines, which need /dev/nvidia*

DEFAULT_USER = "capyctl"
DEFAULT_DATA_DIRS = {
    "standalone": "/var/lib/capyctl",
    "server": "/var/lib/capyctl",
    "worker": "/var/lib/capyctl",
    "host": "/var/lib/capyctl-host",
}
DEFAULT_LISTEN = {"standalone": "127.0.0.1:8000", "server": "127.0.0.1:8000",
                  "host": "0.0.0.0:7070"}  # fmt: skip
# Server mode cannot start without CAPYCTL_DATABASE_URL and CAPYCTL_REDIS_URL: its unit
# always names a file to hold them.
DEFAULT_ENV_FILE = "/etc/capyctl/capyctl.env"

# How long `systemctl stop` waits before SIGKILL, by kind, with what the wait covers:
# standalone drains HTTP (3 s, capyctl.cli.start.GRACEFUL_SHUTDOWN_SECONDS), then ends its
# engines one by one (3 s each before SIGKILL, up to 30 s more for one stuck in the GPU
# driver); a host agent drains its relay (5 s) and gives each engine 10 s; the server's
# supervisor gives its api and workers 8 s each; a worker finishes the operations it runs
# (Celery's warm shutdown).
STOP_TIMEOUT_SECONDS = {"standalone": 90, "server": 60, "worker": 120, "host": 180}

# Home directories, which ProtectHome=yes hides.
HOME_ROOTS = ("/home", "/root", "/run/user")

_USER = re.compile(r"[a-z_][a-z0-9_-]{0,30}")
_PATH_PART = re.compile(r"[A-Za-z0-9._+@%,=~-]+")
_LISTEN = re.compile(r"(?:(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]*):)?(?P<port>[0-9]{1,5})")

DESCRIPTIONS = {
    "standalone": "CapyCTL standalone (API, scheduler and engines in one process)",
    "server": "CapyCTL server (API and Celery workers; PostgreSQL and Redis)",
    "worker": "CapyCTL worker (server mode's operations)",
    "host": "CapyCTL host agent (engines on this GPU machine, mutual TLS)",
}


class UnitValueError(ValueError):
    """A value that cannot go into a unit, said in one line."""


def unit_path(flag: str, value: str) -> str:
    """``value`` if it is a plain absolute path: ``/`` then names of letters, digits and
    ``._+@%,=~-``, no ``.``/``..``/empty segment, not ``/`` itself. Anything else (spaces,
    quotes, ``$``, a backslash, a newline) could change what the unit says."""
    parts = value.split("/")
    if not value.startswith("/") or value == "/":
        raise UnitValueError(f"{flag} {value!r}: give an absolute path, e.g. /var/lib/capyctl")
    for part in parts[1:]:
        if part in ("", ".", ".."):
            raise UnitValueError(f"{flag} {value!r}: write the path without //, /./, /../ "
                                 "or a trailing /")  # fmt: skip
        if not _PATH_PART.fullmatch(part):
            raise UnitValueError(
                f"{flag} {value!r}: a unit's paths may hold only letters, digits and "
                "._+@%,=~- (no spaces, quotes, $ or backslashes)"
            )
    return value


def unit_user(value: str) -> str:
    """A system user name systemd accepts (lowercase, digits, ``_``, ``-``), not root."""
    if not _USER.fullmatch(value):
        raise UnitValueError(
            f"--user {value!r}: a user name is a lowercase letter or _, then lowercase "
            "letters, digits, _ or - (at most 31)"
        )
    if value == "root":
        raise UnitValueError("--user root: the unit runs as a user of its own, never root")
    return value


def unit_listen(flag: str, value: str) -> str:
    """``HOST:PORT``, ``[IPV6]:PORT``, ``:PORT`` or ``PORT`` (as ``capyctl start`` takes it),
    of names, addresses and a port from 1 to 65535 only."""
    found = _LISTEN.fullmatch(value)
    if found is None or not 1 <= int(found["port"]) <= 65535:
        raise UnitValueError(f"{flag} {value!r}: use HOST:PORT with a port from 1 to 65535, "
                             "e.g. 127.0.0.1:8000")  # fmt: skip
    return value


def listen_port(value: str) -> int:
    """The port of a value :func:`unit_listen` passed."""
    found = _LISTEN.fullmatch(value)
    return int(found["port"]) if found else 0


def escape(value: str) -> str:
    """``value`` as systemd reads it back: ``%`` starts a specifier (``%h``, ``%n``)."""
    return value.replace("%", "%%")


def in_home(path: str) -> bool:
    return any(path == root or path.startswith(root + "/") for root in HOME_ROOTS)


@dataclass(frozen=True)
class UnitSpec:
    """What a unit says; values already checked."""

    kind: str
    user: str
    data_dir: str
    program: str
    listen: str | None
    env_file: str | None
    enrol_listen: str | None = None
    workers: int | None = None
    concurrency: int | None = None
    protect_home: str = "yes"
    protect_home_reason: str = ""


def start_command(spec: UnitSpec) -> list[str]:
    """The ``capyctl start`` command line the unit runs (no secrets: those are in the
    environment file)."""
    command = [spec.program, "start", spec.kind]
    if spec.listen is not None:
        command += ["--listen", spec.listen]
    if spec.enrol_listen is not None:
        command += ["--enrol-listen", spec.enrol_listen]
    if spec.workers is not None:
        command += ["--workers", str(spec.workers)]
    if spec.concurrency is not None:
        command += ["--concurrency", str(spec.concurrency)]
    return command


def render_unit(spec: UnitSpec, version: str) -> str:
    """The unit file's text for ``spec``."""
    kind = spec.kind
    gpu = kind in GPU_KINDS
    data_dir = escape(spec.data_dir)
    after = ["network-online.target"]
    if kind in ("server", "worker"):
        # They may run on other machines: order after them where they are here, need none.
        after += ["postgresql.service", "redis.service", "redis-server.service"]
    lines = [
        f"# capyctl service print {kind} (CapyCTL {version}); docs/services.md says how to",
        "# install it. Secrets go in the EnvironmentFile, never on the ExecStart line.",
        "[Unit]",
        f"Description={DESCRIPTIONS[kind]}",
        f"After={' '.join(after)}",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=exec",
        f"User={spec.user}",
        f"Group={spec.user}",
        f"Environment=CAPYCTL_DATA_DIR={data_dir}",
        "# Engines keep their caches (Hugging Face, vLLM, Triton) under $HOME: the data dir is",
        "# the one place this unit may write, besides its own /tmp.",
        f"Environment=HOME={data_dir}",
    ]
    if spec.env_file is not None:
        lines.append(f"EnvironmentFile={escape(spec.env_file)}")
    lines.append(f"WorkingDirectory={data_dir}")
    state = _state_directory(spec.data_dir)
    if state is not None:
        lines += [f"StateDirectory={escape(state)}", "StateDirectoryMode=0700"]
    lines += [
        f"ExecStart={' '.join(escape(word) for word in start_command(spec))}",
        "Restart=on-failure",
        "RestartSec=5",
        *_stopping(kind),
        # The default connection cap (CAPYCTL_HTTP_MAX_CONNECTIONS, 4096) and the engines'
        # files need more than systemd's soft limit of 1024.
        "LimitNOFILE=65536",
        "UMask=0077",
        "",
        "# Hardening",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        f"ReadWritePaths={data_dir}",
    ]
    if spec.protect_home_reason:
        lines.append(f"# {spec.protect_home_reason}")
    lines += [
        f"ProtectHome={spec.protect_home}",
        "PrivateTmp=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectHostname=yes",
        "RestrictSUIDSGID=yes",
        "RestrictRealtime=yes",
        "LockPersonality=yes",
        "SystemCallArchitectures=native",
        *_capabilities(spec),
    ]
    if gpu:
        lines += [
            "# No PrivateDevices=, ProtectClock= or DeviceAllow=: each shuts the engines out",
            "# of /dev/nvidia* (and /dev/dri, /dev/kfd). No MemoryDenyWriteExecute= either:",
            "# CUDA and PyTorch write the code they run.",
        ]
    else:
        lines += [
            "PrivateDevices=yes",
            "ProtectClock=yes",
            "RestrictNamespaces=yes",
            "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
            "SystemCallFilter=@system-service",
            "SystemCallErrorNumber=EPERM",
        ]
    lines += ["", "[Install]", "WantedBy=multi-user.target"]
    return "\n".join(lines) + "\n"


def _state_directory(data_dir: str) -> str | None:
    """``NAME`` for a data dir ``/var/lib/NAME``: systemd then makes it, owned by the
    service user, mode 0700, before the start."""
    prefix = "/var/lib/"
    rest = data_dir[len(prefix) :] if data_dir.startswith(prefix) else ""
    return rest if rest and "/" not in rest else None


def _stopping(kind: str) -> list[str]:
    timeout = f"TimeoutStopSec={STOP_TIMEOUT_SECONDS[kind]}"
    if kind == "host":
        return [
            "# SIGTERM reaches the agent alone, which stops its engines. If the agent crashes",
            "# or is killed, its engines live on, and its next start takes them back",
            '# (docs/multi-host.md, "When an agent dies"): mixed or control-group would',
            "# kill them with it.",
            "KillMode=process",
            timeout,
        ]
    return [
        "# SIGTERM reaches capyctl alone, which drains requests and ends what it started;",
        "# whatever is left when it exits (or after the timeout) is killed.",
        "KillMode=mixed",
        timeout,
    ]


def _capabilities(spec: UnitSpec) -> list[str]:
    ports = [listen_port(value) for value in (spec.listen, spec.enrol_listen) if value]
    if any(port < 1024 for port in ports):  # a port below 1024 needs this one capability
        return [
            "CapabilityBoundingSet=CAP_NET_BIND_SERVICE",
            "AmbientCapabilities=CAP_NET_BIND_SERVICE",
        ]
    return ["CapabilityBoundingSet="]


# --- the command ---------------------------------------------------------------------------


def running_program() -> str | None:
    """The absolute path of the ``capyctl`` program running now: ``sys.argv[0]`` when it
    is one, else the one next to this Python (a virtual environment's), else the one on
    ``PATH``."""
    argv0 = sys.argv[0]
    named = argv0 if os.sep in argv0 else shutil.which(argv0)
    candidates = [named, str(Path(sys.executable).parent / "capyctl"), shutil.which("capyctl")]
    for candidate in candidates:
        if (
            candidate
            and Path(candidate).name == "capyctl"
            and Path(candidate).is_file()
            and os.access(candidate, os.X_OK)
        ):
            return os.path.normpath(Path(candidate).absolute())
    return None


def interpreter(program: str) -> str | None:
    """The program its ``#!`` line names, links resolved (a Python under pyenv or uv may lie
    in a home directory); None for a binary, or a file not here."""
    try:
        with Path(program).open("rb") as handle:
            first = handle.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    if not words or not words[0].startswith("/"):
        return None
    return str(Path(words[0]).resolve())


def protect_home(chosen: str | None, spec_paths: dict[str, str]) -> tuple[str, str]:
    """``ProtectHome=`` and the comment that says why it is ``read-only``: ``yes`` hides
    the home directories, so a unit whose program, Python, data dir or environment file
    lies in one gets ``read-only`` (the data dir stays writable: ReadWritePaths)."""
    homed = [(what, path) for what, path in spec_paths.items() if in_home(path)]
    if chosen == "yes" and homed:
        what, path = homed[0]
        raise UnitValueError(
            f"--protect-home yes: the {what} {path} is in a home directory, which yes hides; "
            "move it, or use --protect-home read-only"
        )
    if chosen is not None:
        return chosen, ""
    if homed:
        what, path = homed[0]
        shown = path if _plain_path(path) else "path"  # a comment line holds plain text only
        return "read-only", f"read-only, not yes: the {what} {shown} is in a home directory"
    return "yes", ""


def _plain_path(path: str) -> bool:
    try:
        unit_path("", path)
    except UnitValueError:
        return False
    return True


def build_spec(args: argparse.Namespace) -> UnitSpec:
    """The unit ``service print`` was asked for, every value checked."""
    kind: str = args.kind
    only = {
        "listen": (kind != "worker", "a worker listens on nothing"),
        "enrol_listen": (kind in ("standalone", "server"), "only standalone and server enrol"),
        "workers": (kind == "server", "only server runs worker processes"),
        "concurrency": (kind == "worker", "only worker takes it"),
    }
    for name, (allowed, why) in only.items():
        if getattr(args, name, None) is not None and not allowed:
            raise UnitValueError(f"--{name.replace('_', '-')} does not fit {kind}: {why}")
    user = unit_user(args.user)
    data_dir = unit_path("--data-dir", getattr(args, "data_dir", None) or DEFAULT_DATA_DIRS[kind])
    env_file = args.env_file or (DEFAULT_ENV_FILE if kind in ("server", "worker") else None)
    if env_file is not None:
        env_file = unit_path("--env-file", env_file)
    if args.capyctl is not None:
        program = unit_path("--capyctl", args.capyctl)
    else:
        found = running_program()
        if found is None:
            raise UnitValueError("cannot tell where the capyctl program is: give --capyctl PATH")
        program = unit_path("--capyctl (the running program)", found)
    listen = args.listen or DEFAULT_LISTEN.get(kind)
    if listen is not None:
        listen = unit_listen("--listen", listen)
    enrol = unit_listen("--enrol-listen", args.enrol_listen) if args.enrol_listen else None
    paths = {"data dir": data_dir, "program": program}
    if str(Path(program).resolve()) != program:  # a link into ~/.local (pipx) counts
        paths["program (links resolved)"] = str(Path(program).resolve())
    python = interpreter(program)
    if python is not None:
        paths["Python (its #! line)"] = python
    if env_file is not None:
        paths["environment file"] = env_file
    home, reason = protect_home(args.protect_home, paths)
    return UnitSpec(
        kind=kind,
        user=user,
        data_dir=data_dir,
        program=program,
        listen=listen,
        env_file=env_file,
        enrol_listen=enrol,
        workers=args.workers,
        concurrency=args.concurrency,
        protect_home=home,
        protect_home_reason=reason,
    )


def service_print(args: argparse.Namespace) -> int:
    """Print the unit; a value that cannot go into one is refused in one line (status 2)."""
    from capyctl import __version__

    try:
        spec = build_spec(args)
    except UnitValueError as exc:
        print(f"capyctl service print: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render_unit(spec, __version__))
    return 0
