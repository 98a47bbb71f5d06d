"""The data dirs are private: what the server and the host agent create is theirs alone
(0700 folders, 0600 files), and a data dir open to others is pointed out at start."""

from __future__ import annotations

import signal
import stat
from pathlib import Path

import pytest

from tests.conftest import run_program, start_server, stop_server
from tests.scheduling import SIM
from tests.test_hosts_join import joined, start_agent  # noqa: F401 - a fixture

pytestmark = pytest.mark.e2e


def open_to_others(root: Path) -> list[str]:
    """Every path under ``root`` (itself included) that its group or others may use."""
    found = []
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            continue
        if mode & 0o077:
            found.append(f"{path.relative_to(root.parent)} {stat.filemode(mode)}")
    return found


def test_a_new_data_dir_and_everything_in_it_are_private(program_env):
    data = Path(program_env["CAPYCTL_DATA_DIR"])
    assert not data.exists()
    server = start_server(program_env)
    try:
        run = lambda *argv: run_program(program_env, *argv)  # noqa: E731
        assert run("host", "add", "gpu1", "--address", "127.0.0.1:7443").code == 0  # the PKI
        assert run("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm").code == 0
        assert run("deployment", "add", "m", "--engine", "sim", "--source", "m",
                   "--gpus", "0").code == 0  # fmt: skip
        started = run("deployment", "start", "m")
        assert started.code == 0, started.err
    finally:
        stop_server(server, signal.SIGTERM)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    files = ["secret_key", "initial-admin-password", "pki/ca.key", "pki/server.key", "pki/ca.crt"]
    if "CAPYCTL_DATABASE_URL" not in program_env:  # SQLite: the database is in the data dir
        files.append("capyctl.sqlite3")
    for name in files:
        assert stat.S_IMODE((data / name).stat().st_mode) == 0o600, name
    assert list((data / "logs").glob("*.log")), "the engine wrote no log"
    assert open_to_others(data) == []
    assert "warning" not in server.log()


def test_a_data_dir_open_to_others_is_pointed_out_in_one_line(program_env):
    data = Path(program_env["CAPYCTL_DATA_DIR"])
    data.mkdir()
    data.chmod(0o755)  # made by an earlier version, or by hand
    server = start_server(program_env)
    stop_server(server, signal.SIGTERM)
    warnings = [line for line in server.log().splitlines() if "warning" in line]
    assert warnings == [
        (
            f"capyctl: warning: the data dir {data} is open to others (mode 0755), yet it "
            f"holds secrets; make it private with: chmod 700 {data}"
        )
    ]
    assert stat.S_IMODE(data.stat().st_mode) == 0o755  # pointed out, never changed


def test_a_host_agents_dir_is_private_and_an_open_one_is_pointed_out(joined):  # noqa: F811
    env, _token, agent_port, agent_dir, agent, _ = joined
    assert stat.S_IMODE(agent_dir.stat().st_mode) == 0o700
    assert sorted(p.name for p in agent_dir.iterdir()) >= ["agent.crt", "agent.json", "agent.key",
                                                         "ca.crt"]  # fmt: skip
    assert open_to_others(agent_dir) == []
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=15) == 0
    agent_dir.chmod(0o750)
    restarted = start_agent(env, agent_dir, agent_port)
    restarted.send_signal(signal.SIGTERM)
    assert restarted.wait(timeout=15) == 0
    log = (agent_dir.parent / f"agent-{agent_port}.log").read_text()
    assert (
        f"capyctl: warning: the data dir {agent_dir} is open to others (mode 0750), yet it "
        f"holds secrets; make it private with: chmod 700 {agent_dir}"
    ) in log.splitlines()
    agent_dir.chmod(0o700)
