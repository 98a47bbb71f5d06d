"""``capyctl start standalone --demo`` (``make demo``): the curl lines it prints answer, the
second simulated model parks the first, and a second start reuses what the first made."""

import json
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest

from capyctl.access.services import find_api_key
from capyctl.cli.demo import (
    LLAMA_ENGINE,
    REAL_MODEL,
    SIM_ENGINE,
    SIM_MODELS,
    next_line,
    set_up_demo,
    tiny_llama,
)
from capyctl.deployments.models import Deployment
from capyctl.engines.models import Engine
from capyctl.events.models import Event
from tests.conftest import run_program, start_server, stop_server

EXPECTED_MODELS = ([REAL_MODEL] if tiny_llama() else []) + list(SIM_MODELS)


def test_a_second_set_up_reuses_the_models_and_replaces_the_key(alice):
    first = set_up_demo("alice")
    second = set_up_demo("alice")
    assert first.models == second.models == EXPECTED_MODELS
    engines = [SIM_ENGINE, LLAMA_ENGINE] if tiny_llama() else [SIM_ENGINE]
    assert sorted(Engine.objects.values_list("name", flat=True)) == sorted(engines)
    assert sorted(Deployment.objects.values_list("name", flat=True)) == sorted(EXPECTED_MODELS)
    added = Event.objects.filter(kind="deployment.added").values_list("subject", flat=True)
    assert sorted(added) == sorted(EXPECTED_MODELS)  # each made once, through the service
    assert find_api_key(first.key) is None  # the earlier demo key is revoked
    key = find_api_key(second.key)
    assert key is not None
    assert (key.user.username, key.name, key.limit_models) == ("alice", "demo", False)
    a, b = (Deployment.objects.get(name=name) for name in SIM_MODELS)
    assert a.gpu_memory_bytes == b.gpu_memory_bytes == 16 * 1024**3  # not both on 24 GiB


def test_the_next_line_points_at_the_first_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fresh = next_line(None, tmp_path / ".capyctl", has_models=False)
    assert fresh.startswith("next: ")
    assert "make demo" in fresh
    assert '"A first model"' in fresh
    assert next_line(None, tmp_path / ".capyctl", has_models=True).endswith(" status")
    elsewhere = next_line(None, tmp_path / "data", has_models=True)
    assert elsewhere.endswith(" --data-dir data status")


def test_the_demo_refuses_a_database_url_in_one_line(program_env, tmp_path):
    env = {**program_env, "CAPYCTL_DATABASE_URL": "postgres://postgres@127.0.0.1:5432/x"}
    data_dir = tmp_path / "demo"
    result = run_program(env, "start", "standalone", "--demo", "--data-dir", str(data_dir))
    assert result.code == 2
    assert result.err == (
        "capyctl: error: --demo keeps its own SQLite database in its data dir; "
        "unset CAPYCTL_DATABASE_URL to run it\n"
    )
    assert not data_dir.exists()


@pytest.mark.e2e
def test_the_printed_curl_lines_answer_and_the_second_model_parks_the_first(program_env):
    env = {k: v for k, v in program_env.items() if k != "CAPYCTL_DATABASE_URL"}  # SQLite
    data_dir = env["CAPYCTL_DATA_DIR"]
    server = start_server(env, "--demo", "--data-dir", data_dir)
    try:
        lines = [line.strip() for line in server.log().splitlines()]
        curls = [line for line in lines if line.startswith("curl ")]
        asked = [json.loads(shlex.split(line)[-1])["model"] for line in curls]
        assert asked == EXPECTED_MODELS
        assert lines[lines.index("Stop with Ctrl-C.") + 1].startswith("next: ")
        for line, model in zip(curls, asked, strict=True):
            done = subprocess.run(
                shlex.split(line), capture_output=True, text=True, timeout=120, check=True
            )
            answer = json.loads(done.stdout)
            assert answer["model"] == model, answer
            text = answer["choices"][0]["message"]["content"]
            if model == REAL_MODEL:  # real words, not the simulation's tokens
                assert re.search(r"[A-Za-z]{3,}", text), text
                assert "tok0" not in text
            else:
                assert text.startswith("tok0 tok1"), text
        listed = json.loads(run_program(env, "deployment", "list", "--json").out)
        states = {d["name"]: (d["observed_state"], d["parked_mode"]) for d in listed}
        first, second = SIM_MODELS
        assert states[first] in {("parked", "ram"), ("parked", "deep")}
        assert states[second] == ("ready", None)
        events = json.loads(run_program(env, "events", "--json", "--model", first).out)
        parked = [e["message"] for e in events if e["kind"] == "deployment.parked"]
        assert parked, events
        assert f"to make room for {second}" in parked[-1]
    finally:
        stop_server(server, signal.SIGTERM)
    assert server.process.returncode == 0
    assert Path(data_dir, "capyctl.sqlite3").exists()  # the data dir it was given
