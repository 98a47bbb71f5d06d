"""Registering engines and deployments and issuing keys with the CLI, as DESIGN §10 says.

Each refused command exits 2 with one line naming the bad value, and changes nothing.
"""

import json
import queue
import signal
import subprocess
import sys
import threading
from datetime import datetime

import pytest

from capyctl.deployments.models import Deployment
from capyctl.engines.models import Engine
from capyctl.events.models import Event
from tests.conftest import CAPYCTL, run_program, table_counts

GIB = 1024**3


@pytest.fixture
def chat(cli):
    """The issue's example: a vLLM engine and a 20 GiB chat deployment."""
    assert cli("engine", "add", "v1", "--kind", "vllm", "--command", "/opt/vllm/bin/vllm").code == 0
    result = cli(
        "deployment", "add", "chat", "--engine", "v1", "--source", "/models/qwen",
        "--gpu-memory", "20GiB", "--alias", "qwen",
    )  # fmt: skip
    assert result.code == 0, result.err
    return Deployment.objects.get(name="chat")


def test_the_example_setup_shows_in_status_json(cli, chat):
    key = cli("key", "create", "--user", "admin")
    assert key.code == 0, key.err
    full_key = key.out.strip()
    assert full_key.startswith("capy_")

    status = cli("status", "--json")
    assert status.code == 0
    data = json.loads(status.out)
    assert [e["name"] for e in data["engines"]] == ["v1"]
    assert data["engines"][0]["kind"] == "vllm"
    (deployment,) = data["deployments"]
    assert deployment["name"] == "chat"
    assert deployment["aliases"] == ["qwen"]
    assert deployment["gpu_memory_bytes"] == 20 * GIB
    assert deployment["desired_state"] == "running"
    assert deployment["observed_state"] == "stopped"
    (key_row,) = data["keys"]
    assert key_row["user"] == "admin"
    assert full_key.startswith(key_row["prefix"] + "_")
    assert full_key not in status.out  # the secret is never shown again
    assert [h["name"] for h in data["hosts"]] == ["local"]
    assert data["hosts"][0]["pools"][-1]["pool"] == "ram"


REFUSALS = [
    (("engine", "add", "v2", "--kind", "nope", "--command", "x"), "unknown engine kind 'nope'"),
    (("engine", "add", "v1", "--kind", "vllm", "--command", "x"), "engine named 'v1' already"),
    (("engine", "add", "Bad_Name", "--kind", "vllm", "--command", "x"), "'Bad_Name'"),
    (
        ("deployment", "add", "chat", "--engine", "v1", "--source", "m"),
        "deployment named 'chat' already exists",
    ),
    (
        ("deployment", "add", "other", "--engine", "v1", "--source", "m", "--alias", "chat"),
        "alias 'chat' is already the name of another deployment",
    ),
    (
        ("deployment", "add", "qwen", "--engine", "v1", "--source", "m"),
        "'qwen' is already an alias of deployment 'chat'",
    ),
    (
        ("deployment", "add", "other", "--engine", "v1", "--source", "m", "--alias", "qwen"),
        "alias 'qwen' is already an alias of deployment 'chat'",
    ),
    (
        (
            "deployment",
            "add",
            "other",
            "--engine",
            "v1",
            "--source",
            "/m",
            "--gpu-memory",
            "20 GB?",
        ),
        "'20 GB?'",
    ),
    (
        ("deployment", "add", "other", "--engine", "v1", "--source", "m", "--gpu-memory", "1.5"),
        "'1.5': a fraction must lie in (0, 1]",
    ),
    (
        ("deployment", "add", "other", "--engine", "nope", "--source", "m"),
        "no engine named 'nope'",
    ),
    (
        ("deployment", "add", "other", "--engine", "v1", "--source", "m", "--weights-size", "x"),
        "'x'",
    ),
    (("deployment", "add", "other", "--engine", "v1", "--source", "m", "--gpus", "-1"), "'-1'"),
    (
        ("deployment", "add", "other", "--engine", "v1", "--source", "m", "--args", "--port 1"),
        "may not set --port",
    ),
    (
        ("deployment", "add", "other", "--engine", "v1", "--source", "m", "--park", "sometimes"),
        "'sometimes'",
    ),
    (("deployment", "add", "other", "--source", "m"), "--engine"),
    (("deployment", "remove", "ghost"), "no deployment named 'ghost'"),
    (("engine", "remove", "v1"), "used by deployments: chat"),
    (("key", "create", "--user", "nobody"), "no user named 'nobody'"),
    (("key", "create", "--user", "admin", "--models", "ghost"), "no deployment named 'ghost'"),
    (("key", "create", "--user", "admin", "--expires", "soon"), "'soon'"),
    (("key", "revoke", "zzzzzzzzzz"), "no API key with id 'zzzzzzzzzz'"),
    (("user", "add", "admin"), "user named 'admin' already exists"),
    (("engine", "frobnicate"), "invalid choice: 'frobnicate'"),
    (
        ("engine", "add", "c1", "--kind", "custom", "--command", "s {port}", "--options", "{x"),
        "invalid --options: not JSON",
    ),
    (
        ("engine", "add", "c1", "--kind", "custom", "--command", "s {port}", "--options", "[]"),
        "must be a JSON object",
    ),
    (
        ("engine", "add", "v2", "--kind", "vllm", "--command", "vllm", "--options", '{"a": 1}'),
        "options are for the 'custom' kind",
    ),
    (
        ("engine", "add", "v2", "--kind", "vllm", "--command", "vllm", "--env", "NOEQUALS"),
        "NAME=VALUE",
    ),
]


@pytest.mark.parametrize(("argv", "message"), REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_mistakes_exit_2_with_one_line_and_change_nothing(cli, chat, argv, message):
    before = table_counts()
    result = cli(*argv)
    assert result.code == 2, (result.out, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert message in lines[0]
    assert "Traceback" not in result.err
    assert table_counts() == before


def test_an_unknown_kind_is_refused_before_anything_exists(cli):
    result = cli("engine", "add", "v1", "--kind", "ollama", "--command", "/usr/bin/ollama")
    assert result.code == 2
    assert "unknown engine kind 'ollama'" in result.err
    assert not Engine.objects.exists()


def test_fractions_and_percentages_of_the_device(cli, chat):
    assert cli(
        "deployment", "add", "half", "--engine", "v1", "--source", "m", "--gpu-memory", "0.5"
    ).code == 0  # fmt: skip
    assert cli(
        "deployment", "add", "most", "--engine", "v1", "--source", "m", "--gpu-memory", "90%"
    ).code == 0  # fmt: skip
    assert cli(
        "deployment", "add", "all", "--engine", "v1", "--source", "m", "--gpu-memory", "1.0"
    ).code == 0  # fmt: skip
    fractions = dict(Deployment.objects.values_list("name", "gpu_memory_fraction"))
    assert fractions == {"chat": None, "half": 0.5, "most": 0.9, "all": 1.0}


def test_every_setting_of_deployment_add_is_kept(cli, chat):
    result = cli(
        "deployment", "add", "coder", "--engine", "v1", "--source", "hf://Qwen/Qwen2.5-Coder",
        "--alias", "Qwen/Qwen2.5-Coder-7B-Instruct", "--alias", "coder:7b",
        "--gpu-memory", "12GiB", "--weights-size", "15GiB", "--gpus", "2", "--park", "deep",
        "--idle-park-seconds", "600", "--min-ready-seconds", "30", "--max-waiting", "50",
        "--max-queue-seconds", "90", "--max-turn-seconds", "20",
        "--wake-timeout", "120", "--start-timeout", "900", "--drain-timeout", "45",
        "--priority", "5", "--args", "--max-model-len 8192 --enforce-eager", "--pinned",
    )  # fmt: skip
    assert result.code == 0, result.err
    coder = Deployment.objects.get(name="coder")
    assert sorted(coder.alias_names) == ["Qwen/Qwen2.5-Coder-7B-Instruct", "coder:7b"]
    assert coder.gpu_memory_bytes == 12 * GIB
    assert coder.weights_bytes == 15 * GIB
    assert coder.gpus == 2
    assert coder.park == "deep"
    assert coder.setting("idle_park_seconds") == 600
    assert coder.setting("min_ready_seconds") == 30
    assert coder.setting("max_waiting") == 50
    assert coder.setting("max_queue_seconds") == 90
    assert coder.setting("max_turn_seconds") == 20
    assert coder.setting("wake_timeout_seconds") == 120
    assert coder.setting("start_timeout_seconds") == 900
    assert coder.setting("drain_timeout_seconds") == 45
    assert coder.priority == 5
    assert coder.pinned is True
    assert coder.engine_args == ["--max-model-len", "8192", "--enforce-eager"]
    assert Event.objects.filter(kind="deployment.added", subject="coder").exists()


def test_settings_left_out_fall_back_to_global_defaults(cli, chat, settings):
    settings.CAPYCTL = {**settings.CAPYCTL, "WAKE_TIMEOUT_SECONDS": 77}
    listed = json.loads(cli("deployment", "list", "--json").out)
    assert listed[0]["wake_timeout_seconds"] == 77
    assert listed[0]["park"] == "auto"


def test_a_kind_that_cannot_park_refuses_a_park_mode(cli):
    cli("engine", "add", "llama", "--kind", "llamacpp", "--command", "/usr/bin/llama-server")
    result = cli(
        "deployment", "add", "tiny", "--engine", "llama", "--source", "/m.gguf", "--park", "ram"
    )
    assert result.code == 2
    assert "cannot park 'ram'" in result.err
    assert not Deployment.objects.exists()


def test_listings_print_tables_and_json(cli, chat):
    table = cli("deployment", "list")
    assert table.code == 0
    header, row = table.out.strip().splitlines()
    assert header.split()[:3] == ["NAME", "ALIASES", "ENGINE"]
    assert row.split()[:3] == ["chat", "qwen", "v1"]
    engines = json.loads(cli("engine", "list", "--json").out)
    assert engines == [
        {
            "name": "v1",
            "kind": "vllm",
            "command": "/opt/vllm/bin/vllm",
            "host": None,
            "parks": "yes",
            "park_kept_memory": None,
            "version": None,
            "version_note": (
                "version unknown until a host runs it (/opt/vllm/bin/vllm: no such program here)"
            ),
            "flags": None,
            "version_checked_at": engines[0]["version_checked_at"],
            "created_at": engines[0]["created_at"],
        }
    ]


# What `capyctl events --json` gives for each event (docs/cli.md).
EVENT_FIELDS = {"id", "time", "kind", "level", "subject", "message", "duration_ms", "actor"}


def test_events_are_listed_oldest_first_as_lines_or_json(cli, chat):
    listed = cli("events", "--json")
    assert listed.code == 0, listed.err
    rows = json.loads(listed.out)
    assert [row["kind"] for row in rows][-2:] == ["engine.added", "deployment.added"]
    assert all(set(row) == EVENT_FIELDS for row in rows)
    added = rows[-1]
    assert (added["subject"], added["level"], added["duration_ms"]) == ("chat", "info", None)
    assert added["message"].startswith("deployment chat added: engine v1, source /models/qwen")
    assert added["id"] > rows[-2]["id"]
    assert datetime.fromisoformat(added["time"]).tzinfo is not None
    (line,) = cli("events", "--limit", "1").out.splitlines()
    assert line.startswith(added["time"][:19].replace("T", " ") + "  INFO    deployment.added ")
    assert line.endswith(added["message"])


@pytest.mark.e2e
def test_events_follow_prints_an_event_that_happens_after_it_started(program_env):
    def add_engine(name: str) -> None:
        added = run_program(program_env, "engine", "add", name, "--kind", "vllm", "--command", "v")
        assert added.code == 0, added.err

    add_engine("v1")
    # Started as from a terminal, SIGINT at its default: a shell that ran the tests in the
    # background left it ignored, and an ignored signal stays ignored across exec.
    as_from_a_terminal = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    follower = subprocess.Popen(
        [sys.executable, "-c", as_from_a_terminal,
         CAPYCTL, "events", "--follow", "--json", "--limit", "1"],
        env=program_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()

    def read_lines() -> None:
        assert follower.stdout is not None
        for line in follower.stdout:
            lines.put(line)

    threading.Thread(target=read_lines, daemon=True).start()
    try:
        before = json.loads(lines.get(timeout=60))  # the newest event before it started
        assert (before["kind"], before["subject"]) == ("engine.added", "v1")
        add_engine("v2")  # from here on, it is following
        after = json.loads(lines.get(timeout=60))
        assert set(after) == EVENT_FIELDS
        assert (after["kind"], after["subject"]) == ("engine.added", "v2")
        assert after["id"] > before["id"]
        assert lines.empty()
    finally:
        follower.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            follower.wait(timeout=15)
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait()
    assert follower.returncode == 130
    assert follower.stderr is not None
    assert "Traceback" not in follower.stderr.read()


def test_removing_things(cli, chat):
    assert cli("deployment", "remove", "qwen").code == 0  # by alias
    assert not Deployment.objects.exists()
    assert cli("engine", "remove", "v1").code == 0
    assert not Engine.objects.exists()
    kinds = list(Event.objects.values_list("kind", flat=True))
    assert "deployment.removed" in kinds
    assert "engine.removed" in kinds


def test_a_running_deployment_cannot_be_removed(cli, chat):
    Deployment.objects.filter(pk=chat.pk).update(observed_state="ready")
    result = cli("deployment", "remove", "chat")
    assert result.code == 2
    assert "is ready; stop it first" in result.err
    assert Deployment.objects.filter(pk=chat.pk).exists()


def test_engines_on_a_named_host(cli):
    assert (
        cli("engine", "add", "v1", "--kind", "vllm", "--command", "vllm", "--host", "local").code
        == 0
    )
    assert (
        cli("engine", "add", "v2", "--kind", "vllm", "--command", "vllm", "--host", "gpu-box").code
        == 2
    )
    assert cli("deployment", "add", "a", "--engine", "v1", "--source", "m").code == 0
    host = Deployment.objects.get(name="a").host
    assert host is not None
    assert host.name == "local"


def test_custom_engines_with_env_and_hooks(cli):
    options = {
        "health_path": "/ready",
        "park": {"deep": {"path": "/unload"}},
        "wake": {"deep": {"path": "/load"}},
    }
    result = cli(
        "engine", "add", "mine", "--kind", "custom",
        "--command", "my-server --host {host} --port {port} --key-file {api_key_file}",
        "--env", "OMP_NUM_THREADS=4", "--options", json.dumps(options),
    )  # fmt: skip
    assert result.code == 0, result.err
    engine = Engine.objects.get(name="mine")
    assert engine.env == {"OMP_NUM_THREADS": "4"}
    assert engine.options == options
    deep = cli("deployment", "add", "m", "--engine", "mine", "--source", "m", "--park", "deep")
    assert deep.code == 0, deep.err
    ram = cli("deployment", "add", "n", "--engine", "mine", "--source", "m", "--park", "ram")
    assert ram.code == 2
    assert "cannot park 'ram'" in ram.err


def test_no_command_prints_help_and_exits_2(cli):
    result = cli()
    assert result.code == 2
    assert "usage: capyctl" in result.err


def test_figures_past_what_the_database_holds_are_refused_in_one_line(cli):
    """The bounds live in the services, so the CLI, REST and admin all refuse them."""
    assert cli("engine", "add", "v1", "--kind", "vllm", "--command", "/opt/vllm/bin/vllm").code == 0
    before = table_counts()
    for flag, words in [
        ("--idle-park-seconds", "invalid idle park seconds 99999999999999999999: use 0 to"),
        ("--max-waiting", "invalid max waiting 99999999999999999999: use 1 to"),
        ("--max-queue-seconds", "invalid max queue seconds 99999999999999999999: use 1 to"),
        ("--max-turn-seconds", "invalid max turn seconds 99999999999999999999: use 0 to"),
        ("--priority", "invalid priority 99999999999999999999: use -1000 to 1000"),
    ]:
        result = cli("deployment", "add", "x", "--engine", "v1", "--source", "m",
                     flag, "99999999999999999999")  # fmt: skip
        assert result.code == 2, result.err  # a mistake: docs/cli.md, "Errors"
        assert result.err.count("\n") == 1, result.err  # one line
        assert words in result.err
    assert table_counts() == before


def test_a_migration_file_not_yet_applied_is_noticed_without_the_graph(db):
    """Commands skip the migration graph only when every migration file is recorded as
    applied; one unrecorded file sends them to the migration executor."""
    from django.db.migrations.recorder import MigrationRecorder

    from capyctl.bootstrap import _every_migration_file_applied

    assert _every_migration_file_applied()
    latest = MigrationRecorder.Migration.objects.filter(app="hosts").order_by("-name").first()
    assert latest is not None
    latest.delete()
    assert not _every_migration_file_applied()
