"""``capyctl service print KIND``: systemd units that systemd accepts, hardened, running the
real ``capyctl start`` command, and refusing any value that could change what they say."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from capyctl.cli import run
from capyctl.cli.parser import build_parser
from capyctl.cli.service import KINDS

PROGRAM = str(Path(sys.executable).parent / "capyctl")  # this checkout's, which exists
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def print_unit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``capyctl service print ARGV`` in this process: (status, stdout, stderr)."""
    try:
        status = run(["service", "print", *argv])
    except SystemExit as exc:  # argparse refuses by exiting
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def unit_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    status, out, err = print_unit(capsys, *argv)
    assert (status, err) == (0, "")
    return out


def settings_of(unit: str) -> dict[str, list[str]]:
    """Each ``Key=value`` of the unit (keys may repeat), comments left out."""
    found: dict[str, list[str]] = {}
    for line in unit.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def one(unit: str, key: str) -> str:
    values = settings_of(unit)[key]
    assert len(values) == 1, values
    return values[0]


def verify(unit: str, directory: Path, name: str = "capyctl-test.service") -> str:
    """What ``systemd-analyze verify`` says about the unit (it names the file or the unit
    on each complaint; rc 0 alone is not enough: unknown keys and bad values are only
    warned about, and ignored)."""
    assert SYSTEMD_ANALYZE is not None, (
        "systemd-analyze is missing: the units are checked with it "
        "(Debian: apt-get install systemd)"
    )
    path = directory / name
    path.write_text(unit)
    done = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    said = [line for line in (done.stdout + done.stderr).splitlines() if name in line]
    if done.returncode != 0:
        said.append(f"exit status {done.returncode}: {done.stdout}{done.stderr}")
    return "\n".join(said)


# --- systemd accepts them ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_passes_systemd_analyze_verify(capsys, tmp_path, kind):
    unit = unit_of(capsys, kind, "--capyctl", PROGRAM)
    assert verify(unit, tmp_path, f"capyctl-{kind}.service") == ""


@pytest.mark.parametrize("kind", KINDS)
def test_every_option_at_once_passes_verify(capsys, tmp_path, kind):
    """A data dir outside /var/lib (no StateDirectory), in a home, with a % in its name; a
    port below 1024; an environment file; each kind's own flags."""
    extra = {
        "standalone": ["--listen", "0.0.0.0:443", "--enrol-listen", ":7443"],
        "server": ["--listen", "[::1]:80", "--enrol-listen", "10.0.0.1:7443", "--workers", "3"],
        "worker": ["--concurrency", "16"],
        "host": ["--listen", "gpu1.example.org:7070"],
    }[kind]
    unit = unit_of(
        capsys, kind, "--capyctl", PROGRAM, "--user", "capy-svc", "--data-dir",
        "/home/capy/data%h", "--env-file", "/etc/capyctl/secret.env", *extra,
    )  # fmt: skip
    assert verify(unit, tmp_path) == ""
    assert one(unit, "ReadWritePaths") == "/home/capy/data%%h"
    assert "StateDirectory" not in settings_of(unit)


def test_verify_is_not_satisfied_by_a_broken_unit(capsys, tmp_path):
    """The check above can fail: a misspelt value and an unknown key are caught, though
    systemd-analyze exits 0 for both."""
    unit = unit_of(capsys, "server", "--capyctl", PROGRAM)
    broken = unit.replace("KillMode=mixed", "KillMode=mixd").replace(
        "PrivateTmp=yes", "PrivateTmp=yes\nProtectEverything=yes"
    )
    said = verify(broken, tmp_path)
    assert "mixd" in said
    assert "ProtectEverything" in said


# --- what they run -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["standalone"], ["start", "standalone", "--listen", "127.0.0.1:8000"]),
        (["standalone", "--enrol-listen", "0.0.0.0:7443"],
         ["start", "standalone", "--listen", "127.0.0.1:8000", "--enrol-listen", "0.0.0.0:7443"]),
        (["server", "--workers", "4", "--listen", ":8080"],
         ["start", "server", "--listen", ":8080", "--workers", "4"]),
        (["worker", "--concurrency", "2"], ["start", "worker", "--concurrency", "2"]),
        (["host"], ["start", "host", "--listen", "0.0.0.0:7070"]),
        (["host", "--listen", "10.0.0.5:7070"], ["start", "host", "--listen", "10.0.0.5:7070"]),
    ],
)  # fmt: skip
def test_exec_start_is_the_start_command_capyctl_parses(capsys, argv, expected):
    unit = unit_of(capsys, *argv, "--capyctl", "/opt/capyctl/bin/capyctl")
    words = one(unit, "ExecStart").split()
    assert words == ["/opt/capyctl/bin/capyctl", *expected]
    args = build_parser().parse_args(words[1:])  # the very command line capyctl would get
    assert args.handler is not None
    assert getattr(args, "listen", None) == (None if argv[0] == "worker" else expected[3])


def test_printing_a_unit_loads_no_django(tmp_path):
    """A GPU machine with the host agent alone (no Django installed) prints its unit."""
    code = (
        "import sys\n"
        "from capyctl.cli import run\n"
        f"status = run(['service', 'print', 'host', '--capyctl', {PROGRAM!r}])\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'celery'))\n"
        "print(status, loaded, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stderr == "0 []\n"
    assert "ExecStart=" in done.stdout


def test_the_running_capyctl_is_the_default_program(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [PROGRAM, "service", "print", "host"])
    unit = unit_of(capsys, "host")
    assert one(unit, "ExecStart").split()[0] == PROGRAM


def test_server_mode_secrets_come_from_an_environment_file(capsys):
    """The database and Redis URLs (with their passwords) live in a root-only file that
    systemd reads; the command line, which any local user can see, has none."""
    for kind in ("server", "worker"):
        unit = unit_of(capsys, kind, "--capyctl", PROGRAM)
        assert one(unit, "EnvironmentFile") == "/etc/capyctl/capyctl.env"
        assert one(unit, "ExecStart").split()[1:3] == ["start", kind]
    unit = unit_of(capsys, "standalone", "--capyctl", PROGRAM)
    assert "EnvironmentFile" not in settings_of(unit)
    unit = unit_of(capsys, "host", "--capyctl", PROGRAM, "--env-file", "/etc/capyctl/host.env")
    assert one(unit, "EnvironmentFile") == "/etc/capyctl/host.env"


# --- hardening -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_runs_as_its_own_user_and_writes_only_its_data_dir(capsys, kind):
    unit = unit_of(capsys, kind, "--capyctl", "/opt/capyctl/bin/capyctl", "--user", "llm")
    data_dir = "/var/lib/capyctl-host" if kind == "host" else "/var/lib/capyctl"
    expected = {
        "User": "llm",
        "Group": "llm",
        "ProtectSystem": "strict",
        "ReadWritePaths": data_dir,
        "WorkingDirectory": data_dir,
        "StateDirectory": data_dir.rsplit("/", 1)[1],
        "StateDirectoryMode": "0700",
        "PrivateTmp": "yes",
        "NoNewPrivileges": "yes",
        "ProtectHome": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectControlGroups": "yes",
        "RestrictSUIDSGID": "yes",
        "LockPersonality": "yes",
        "CapabilityBoundingSet": "",
        "UMask": "0077",
        "Restart": "on-failure",
    }
    assert {key: one(unit, key) for key in expected} == expected
    assert f"CAPYCTL_DATA_DIR={data_dir}" in settings_of(unit)["Environment"]
    assert one(unit, "After").split()[0] == "network-online.target"
    # PostgreSQL and Redis may be on other machines: ordered after, never required.
    assert settings_of(unit)["Wants"] == ["network-online.target"]
    assert not {"Requires", "BindsTo", "Requisite"} & set(settings_of(unit))


@pytest.mark.parametrize("kind", ["standalone", "host"])
def test_kinds_that_run_engines_keep_the_gpus_reachable(capsys, kind):
    """PrivateDevices=, ProtectClock= (which implies DeviceAllow=char-rtc) and any
    DeviceAllow= would each shut the engines out of /dev/nvidia*."""
    keys = settings_of(unit_of(capsys, kind, "--capyctl", PROGRAM))
    assert not {"PrivateDevices", "ProtectClock", "DeviceAllow", "DevicePolicy"} & set(keys)
    assert "MemoryDenyWriteExecute" not in keys


@pytest.mark.parametrize("kind", ["server", "worker"])
def test_kinds_without_engines_get_no_devices(capsys, kind):
    unit = unit_of(capsys, kind, "--capyctl", PROGRAM)
    assert one(unit, "PrivateDevices") == "yes"
    assert one(unit, "SystemCallFilter") == "@system-service"


def test_a_stop_lets_capyctl_end_what_it_started(capsys):
    """SIGTERM goes to capyctl alone, which drains and ends its engines; a host agent's
    engines outlive a crash of the agent (its next start takes them back), so only the
    agent is killed."""
    kill_modes = {
        kind: one(unit_of(capsys, kind, "--capyctl", PROGRAM), "KillMode") for kind in KINDS
    }
    assert kill_modes == {"standalone": "mixed", "server": "mixed", "worker": "mixed",
                          "host": "process"}  # fmt: skip


def test_a_port_below_1024_gets_the_one_capability_it_needs(capsys):
    unit = unit_of(capsys, "standalone", "--capyctl", PROGRAM, "--listen", "0.0.0.0:443")
    assert one(unit, "CapabilityBoundingSet") == "CAP_NET_BIND_SERVICE"
    assert one(unit, "AmbientCapabilities") == "CAP_NET_BIND_SERVICE"


def test_a_python_in_a_home_directory_stays_readable(capsys, tmp_path):
    """ProtectHome=yes would hide a Python under ~/.pyenv or uv's: the unit could not
    start. It gets read-only, and says why."""
    program = tmp_path / "capyctl"
    program.write_text("#!/home/alice/.pyenv/versions/3.11/bin/python\nimport sys\n")
    program.chmod(0o755)
    unit = unit_of(capsys, "host", "--capyctl", str(program))
    assert one(unit, "ProtectHome") == "read-only"
    assert "# read-only, not yes: the Python (its #! line) /home/alice/.pyenv/" in unit
    unit = unit_of(capsys, "host", "--capyctl", "/opt/x/capyctl", "--data-dir", "/root/agent")
    assert one(unit, "ProtectHome") == "read-only"
    assert one(unit, "ReadWritePaths") == "/root/agent"  # writable in the read-only home
    program.unlink()
    program.write_text("#!/home/al\\ice/python\n")  # a path no unit line may hold
    program.chmod(0o755)
    unit = unit_of(capsys, "host", "--capyctl", str(program))
    assert "# read-only, not yes: the Python (its #! line) path is in a home directory" in unit
    assert "al\\ice" not in unit


def test_a_program_linked_from_a_home_directory_counts_as_there(capsys, tmp_path):
    """pipx puts a link in /usr/local/bin (or ~/.local/bin) to a program in a home."""
    link = tmp_path / "capyctl"
    link.symlink_to("/home/alice/.local/pipx/venvs/capyctl/bin/capyctl")
    unit = unit_of(capsys, "standalone", "--capyctl", str(link))
    assert one(unit, "ExecStart").split()[0] == str(link)
    assert one(unit, "ProtectHome") == "read-only"


# --- values refused ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["standalone", "--data-dir", "var/lib/capyctl"], "give an absolute path"),
        (["standalone", "--data-dir", "/"], "give an absolute path"),
        (["standalone", "--data-dir", "/srv/my models"], "no spaces"),
        (["standalone", "--data-dir", "/srv/x\nExecStartPre=/bin/sh"], "no spaces"),
        (["standalone", "--data-dir", "/srv/$HOME"], "no spaces, quotes, $"),
        (["standalone", "--data-dir", "/srv/../etc"], "without //, /./, /../"),
        (["standalone", "--data-dir", "/srv/capyctl/"], "trailing /"),
        (["server", "--env-file", "capyctl.env"], "--env-file 'capyctl.env': give an absolute"),
        (["host", "--capyctl", "/opt/bin/capyctl;reboot"], "--capyctl"),
        (["host", "--capyctl", '/opt/"x"/capyctl'], "quotes"),
        (["standalone", "--user", "root"], "never root"),
        (["standalone", "--user", "Alice"], "a user name is a lowercase letter"),
        (["standalone", "--user", "a b"], "a user name is"),
        (["standalone", "--listen", "127.0.0.1:99999"], "a port from 1 to 65535"),
        (["standalone", "--listen", "127.0.0.1:0"], "a port from 1 to 65535"),
        (["standalone", "--listen", "$(id):80"], "use HOST:PORT"),
        (["server", "--enrol-listen", "x y:7443"], "--enrol-listen"),
        (["worker", "--listen", "127.0.0.1:8000"], "--listen does not fit worker"),
        (["host", "--enrol-listen", ":7443"], "--enrol-listen does not fit host"),
        (["host", "--workers", "2"], "--workers does not fit host"),
        (["server", "--concurrency", "2"], "--concurrency does not fit server"),
        (["host", "--protect-home", "yes", "--data-dir", "/home/gpu/agent"],
         "the data dir /home/gpu/agent is in a home directory"),
        (["api"], "invalid choice: 'api'"),
        (["standalone", "--workers", "0"], "must be at least 1"),
        (["standalone", "--protect-home", "no"], "invalid choice: 'no'"),
    ],
)  # fmt: skip
def test_a_value_that_cannot_go_into_a_unit_is_refused_in_one_line(capsys, argv, says):
    # This checkout's program unless the case gives one (the later flag wins).
    status, out, err = print_unit(capsys, argv[0], "--capyctl", PROGRAM, *argv[1:])
    assert status == 2
    assert out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("capyctl service print: error: ")
    assert says in err


def test_percent_signs_are_written_as_systemd_reads_them_back(capsys, tmp_path):
    """``%h`` in a unit is the service user's home: a data dir with a ``%`` in its name
    is written ``%%``, everywhere it goes."""
    unit = unit_of(capsys, "standalone", "--capyctl", PROGRAM, "--data-dir", "/srv/100%h")
    assert "/srv/100%h" not in unit.replace("%%", "")
    for key in ("WorkingDirectory", "ReadWritePaths"):
        assert one(unit, key) == "/srv/100%%h"
    assert "CAPYCTL_DATA_DIR=/srv/100%%h" in settings_of(unit)["Environment"]
    assert verify(unit, tmp_path) == ""
