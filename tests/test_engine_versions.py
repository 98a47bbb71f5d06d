"""CapyCTL knows each engine's version: it asks the program itself (``--version``, and
``--help`` where its flags matter) at ``engine add`` and on the host before the first
launch, records it, and refuses a flag that version lacks with one line instead of an
engine that exits at start. A TensorFold whose help lists the sleep API parks ``deep``
through it; an older one is stopped, as before."""

import hashlib
import hmac
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from rest_framework.test import APIClient

from capyctl.deployments.models import Deployment
from capyctl.engines.models import Engine
from capyctl.engines.services import add_engine
from capyctl.events.models import Event
from capyctl.scheduler import actions
from capyctl.scheduler.errors import EngineFailedError
from hostagent.kinds import get_kind
from hostagent.runtime import free_port
from hostagent.versions import (
    EngineProbeError,
    ProbeCommands,
    detect,
    missing_flag,
    parse_version,
)
from tests.scheduling import SIM, SIM_ENV, deployment, state
from tests.test_llama_server import llama_server_binary

OLD = {**SIM_ENV, "CAPYCTL_SIM_VERSION": "0.5.3"}  # before keys and sleep
NEW = {**SIM_ENV, "CAPYCTL_SIM_VERSION": "0.6.5"}
TF = get_kind("tensorfold")


def tensorfold(name, env):
    return add_engine(name, kind="tensorfold", command=f"{SIM} tensorfold", env=env)


# -- reading the program ------------------------------------------------------------------


def test_the_versions_are_read_as_each_real_program_prints_them():
    assert parse_version("tensorfold 0.6.5\n") == "0.6.5"
    assert parse_version("0.33.0\n") == "0.33.0"  # vllm --version
    assert parse_version("\nversion: 6500 (1a2b3c4d)\nbuilt with cc\n") == "6500 (1a2b3c4d)"


def test_the_real_llama_server_says_its_version_and_flags():
    found = detect([llama_server_binary()], get_kind("llamacpp").probes or ProbeCommands())
    assert found.version  # on stderr, "version: N (hash)"; this build: 0.6.0-dev (...)
    assert found.flags is not None
    assert {"--api-key", "--api-key-file", "--alias", "-m", "--ctx-size"} <= found.flags
    assert "--enable-sleep-mode" not in found.flags


def test_an_old_simulated_tensorfold_lacks_keys_and_sleep_as_the_old_real_ones_do():
    argv = [sys.executable, "-m", "hostagent.sim", "tensorfold"]
    old = detect(argv, TF.probes or ProbeCommands(), env=OLD)
    new = detect(argv, TF.probes or ProbeCommands(), env=NEW)
    assert (old.version, new.version) == ("0.5.3", "0.6.5")
    assert old.flags is not None
    assert new.flags is not None
    assert {"--name", "--no-update-check"} <= old.flags
    assert not {"--api-key", "--api-key-file", "--enable-sleep-mode"} & old.flags
    assert {"--api-key", "--api-key-file", "--enable-sleep-mode"} <= new.flags
    assert TF.capabilities({}, old).deep is False
    assert TF.capabilities({}, new).deep is True


def test_the_questions_run_without_the_hosts_secrets_and_with_a_timeout(monkeypatch):
    monkeypatch.setenv("TENSORFOLD_API_KEY", "host-key")
    monkeypatch.setenv("SOME_TOKEN", "host-secret")
    clean = (
        "import os; secret = {'TENSORFOLD_API_KEY', 'SOME_TOKEN'} & set(os.environ); "
        "print('9.9' if secret else '0.1', os.environ['LANG'])"
    )
    found = detect([sys.executable, "-c", clean], ProbeCommands(version=[]), env={"X": "1"})
    assert found.version == "0.1"
    with pytest.raises(EngineProbeError, match="did not answer within 1s"):
        detect([sys.executable, "-c", "import time; time.sleep(30)"], ProbeCommands(), timeout=1)
    with pytest.raises(EngineProbeError, match="no such program here"):
        detect(["/nonexistent/tensorfold"], ProbeCommands())
    with pytest.raises(EngineProbeError, match="exited 1: broken"):
        detect([sys.executable, "-c", "import sys; sys.exit('broken')"], ProbeCommands())


def test_vllm_is_asked_for_every_flag_and_read_with_its_own_spelling():
    vllm = get_kind("vllm")
    probes = vllm.probes or ProbeCommands()
    found = detect([sys.executable, "-m", "hostagent.sim", "vllm"], probes, env=SIM_ENV)
    assert found.version == "0.33.0"
    assert found.help_command == "serve --help=all"  # plain --help lists its groups only
    assert found.flags is not None
    assert {"--max-model-len", "--optimization-level", "--compilation-config"} <= found.flags
    # vLLM reads _ for -, --x.y as a key of the JSON flag --x, -O3 as --optimization-level.
    given = ["--max_model_len", "4096", "-O3", "--compilation-config.mode=3", "--no-enforce-eager"]
    assert missing_flag(found, given, probes.spelling) is None
    assert missing_flag(found, ["--max-model-length-x", "1"], probes.spelling) == (
        "--max-model-length-x"
    )
    assert missing_flag(found, ["--max_model_len", "1"]) == "--max_model_len"  # exact


def test_a_help_that_does_not_answer_keeps_the_version_and_refuses_nothing():
    slow_help = (
        "import sys, time\nif '--version' in sys.argv: print('1.2.3'); sys.exit()\ntime.sleep(30)"
    )
    found = detect(
        [sys.executable, "-c", slow_help], ProbeCommands(help=["--help"], help_timeout=1)
    )
    assert found.version == "1.2.3"
    assert found.flags is None
    assert "did not answer within 1s" in found.note
    assert missing_flag(found, ["--anything"]) is None


# -- at engine add and deployment add -------------------------------------------------------


@pytest.mark.django_db
def test_a_flag_an_old_tensorfold_lacks_is_refused_with_one_line(cli):
    assert cli("engine", "add", "tf-old", "--kind", "tensorfold", "--command",
               f"{SIM} tensorfold", "--env", "CAPYCTL_SIM_VERSION=0.5.3").code == 0  # fmt: skip
    engine = Engine.objects.get(name="tf-old")
    assert engine.version == "0.5.3"
    assert engine.flags is not None
    assert "--api-key-file" not in engine.flags
    refused = cli("deployment", "add", "chat", "--engine", "tf-old", "--source", "models/chat",
                  "--gpu-memory", "8GiB", "--args", "--api-key-file /etc/keys")  # fmt: skip
    assert refused.code == 2
    assert refused.err == (
        "capyctl: error: engine 'tf-old' (0.5.3) has no --api-key-file flag: its "
        "`serve --help` does not list it\n"
    )
    assert not Deployment.objects.exists()
    assert cli("deployment", "add", "chat", "--engine", "tf-old", "--source", "models/chat",
               "--args", "--sleep-cache-dir /x").code == 2  # fmt: skip
    # What it has passes (a value is not a flag).
    assert cli("deployment", "add", "chat", "--engine", "tf-old", "--source", "models/chat",
               "--gpu-memory", "8GiB", "--args", "--context 4096").code == 0  # fmt: skip

    listed = cli("engine", "list")
    assert listed.out.splitlines()[0].split() == [
        "NAME", "KIND", "HOST", "PARKS", "VERSION", "COMMAND"
    ]  # fmt: skip
    assert "  no     0.5.3  " in listed.out  # an old TensorFold cannot park
    (shown,) = json.loads(cli("engine", "list", "--json").out)
    assert shown["version"] == "0.5.3"
    assert "--name" in shown["flags"]


@pytest.mark.django_db
def test_an_engine_only_a_host_can_run_is_added_with_its_version_unknown(cli, alice):
    assert cli("engine", "add", "tf", "--kind", "tensorfold", "--command",
               "/opt/tensorfold/bin/tensorfold").code == 0  # fmt: skip
    engine = Engine.objects.get(name="tf")
    assert engine.version == ""
    assert engine.version_note.startswith("version unknown until a host runs it")
    assert engine.features() is None or engine.features().flags is None  # type: ignore[union-attr]
    # Nothing is known to refuse, and it parks nothing until a host says it can.
    ok = cli("deployment", "add", "m", "--engine", "tf", "--source", "models/m",
             "--args", "--context 4096")  # fmt: skip
    assert ok.code == 0
    rest = APIClient()
    rest.force_login(alice)
    (via_rest,) = rest.get("/api/engines/").json()["results"]
    assert via_rest["version"] is None
    assert via_rest["version_note"].startswith("version unknown until a host runs it")
    assert via_rest["parks"] == "no"


@pytest.mark.django_db
def test_an_engine_on_a_remote_host_is_not_asked_here(cli, data_dir):
    from capyctl.hosts.services import add_host

    add_host("gpu-box", "10.0.0.5:7443")
    # The command would run here, but it is the remote host's program: only it may say.
    engine = tensorfold_on("gpu-box")
    assert engine.version == ""
    assert engine.version_note == "version unknown until a host runs it"
    added = Event.objects.get(kind="engine.added").message
    assert added.endswith("(version unknown until a host runs it)")
    listed = {line.split()[0]: line.split() for line in cli("engine", "list").out.splitlines()}
    assert listed["tf"][4] == "unknown"


def tensorfold_on(host):
    return add_engine("tf", kind="tensorfold", command=f"{SIM} tensorfold", host=host, env=NEW)


# -- on the host, before its first launch there --------------------------------------------


def _script(path: Path, version: str) -> str:
    """A program that appears after `engine add`: the simulated TensorFold, version fixed."""
    path.write_text(f'#!/bin/sh\nCAPYCTL_SIM_VERSION={version} exec {SIM} tensorfold "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.mark.django_db(transaction=True)
def test_the_host_reads_the_version_at_its_first_launch_and_records_it(gpu24, tmp_path, weights):
    program = tmp_path / "tensorfold"
    add_engine("tf", kind="tensorfold", command=str(program), env=SIM_ENV)
    assert Engine.objects.get(name="tf").version == ""
    _script(program, "0.6.5")
    a = deployment("a", engine="tf", source=weights)
    actions.ensure_ready(a.pk)
    engine = Engine.objects.get(name="tf")
    assert engine.version == "0.6.5"
    assert engine.flags is not None
    assert "--enable-sleep-mode" in engine.flags
    (said,) = Event.objects.filter(kind="engine.version").values_list("message", flat=True)
    assert said == "engine tf: host local runs 0.6.5"


@pytest.mark.django_db(transaction=True)
def test_a_flag_the_hosts_copy_lacks_fails_the_start_before_any_process(gpu24, tmp_path, weights):
    program = tmp_path / "tensorfold"
    add_engine("tf", kind="tensorfold", command=str(program), env=SIM_ENV)
    a = deployment(
        "a", engine="tf", source=weights, engine_args=["--sleep-cache-dir", str(tmp_path / "cache")]
    )
    _script(program, "0.5.3")
    with pytest.raises(EngineFailedError) as failed:
        actions.ensure_ready(a.pk)
    assert str(failed.value) == (
        "a: the engine failed to start: tensorfold on this host (0.5.3) has no "
        "--sleep-cache-dir flag: its `serve --help` does not list it"
    )
    assert state("a") == ("failed", "")
    assert not list((tmp_path / "logs").glob("*.log"))  # nothing was launched


# -- TensorFold's sleep ---------------------------------------------------------------------


@pytest.fixture
def weights(tmp_path):
    """A model directory on this host (a bare Hub id would be fetched first)."""
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return str(folder)


def _engine_process(name: str) -> psutil.Process:
    instance = Deployment.objects.get(name=name).instances.get()
    return psutil.Process(instance.pid)


@pytest.mark.django_db(transaction=True)
def test_a_tensorfold_with_the_sleep_api_parks_deep_and_wakes_through_it(
    gpu24, monkeypatch, weights
):
    monkeypatch.setenv("TENSORFOLD_SLEEP_TOKEN", "the-hosts-token")
    tensorfold("tf", {**NEW, "TENSORFOLD_SLEEP_TOKEN": "an-engine-env-token"})
    a = deployment("a", engine="tf", source=weights)
    b = deployment("b", engine="tf", source=weights)
    actions.ensure_ready(a.pk)
    engine = _engine_process("a")
    assert "--enable-sleep-mode" in engine.cmdline()
    token = engine.environ()["TENSORFOLD_SLEEP_TOKEN"]
    key = Deployment.objects.get(name="a").instances.get().launch_key
    assert token == hmac.new(key.encode(), b"tensorfold-sleep", hashlib.sha256).hexdigest()
    assert not any(token in arg or key in arg for arg in engine.cmdline())

    actions.ensure_ready(b.pk, timeout=20)  # b needs a's room: a sleeps, deep
    assert state("a") == ("parked", "deep")
    assert state("b") == ("ready", "")
    assert engine.is_running()  # the same process: parked, not stopped
    actions.ensure_ready(a.pk, timeout=20)  # a wakes (b sleeps for it)
    assert state("a") == ("ready", "")
    assert state("b") == ("parked", "deep")
    assert _engine_process("a").pid == engine.pid


@pytest.mark.django_db(transaction=True)
def test_a_tensorfold_without_it_is_stopped_to_make_room(gpu24, weights):
    tensorfold("tf", OLD)
    a = deployment("a", engine="tf", source=weights)
    b = deployment("b", engine="tf", source=weights)
    actions.ensure_ready(a.pk)
    assert "--enable-sleep-mode" not in _engine_process("a").cmdline()
    actions.ensure_ready(b.pk, timeout=20)
    assert state("a") == ("stopped", "")
    assert state("b") == ("ready", "")


def _serve_sim(args, env, port):
    """A bare simulated TensorFold 0.6.5 on ``port``, with only ``env``'s sleep token."""
    full = {k: v for k, v in os.environ.items() if k != "TENSORFOLD_SLEEP_TOKEN"}
    return subprocess.Popen(
        [sys.executable, "-m", "hostagent.sim", "tensorfold", "serve", "m", "--port",
         str(port), *args],
        env={**full, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def _healthy(base):
    for _ in range(200):
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{base} never answered /health")


def test_the_simulated_sleep_api_answers_as_tensorfolds_docs_say():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    engine = _serve_sim(["--enable-sleep-mode"], {"TENSORFOLD_SLEEP_TOKEN": "t0ken"}, port)
    try:
        _healthy(base)
        good = {"Authorization": "Bearer t0ken"}
        assert httpx.get(f"{base}/is_sleeping").status_code == 401
        wrong = {"Authorization": "Bearer not-it"}
        assert httpx.post(f"{base}/sleep?level=2", headers=wrong).status_code == 401
        browser = {**good, "Origin": "http://example.com"}
        assert httpx.post(f"{base}/sleep?level=2", headers=browser).status_code == 403
        assert httpx.post(f"{base}/sleep?level=1", headers=good).status_code == 400
        slept = httpx.post(f"{base}/v1/sleep?level=2", headers=good).json()  # /v1 too
        assert (slept["state"], slept["is_sleeping"], slept["ready"]) == ("sleeping", True, False)
        assert httpx.get(f"{base}/health").status_code == 200  # health says nothing of sleep
        woke = httpx.post(f"{base}/wake_up", headers=good).json()
        assert (woke["state"], woke["is_sleeping"], woke["ready"]) == ("awake", False, True)
    finally:
        engine.terminate()
        engine.wait(10)

    port = free_port()
    plain = _serve_sim([], {}, port)
    try:
        _healthy(f"http://127.0.0.1:{port}")
        answer = httpx.post(f"http://127.0.0.1:{port}/sleep?level=2")
        assert answer.status_code == 404  # no --enable-sleep-mode: no sleep routes
    finally:
        plain.terminate()
        plain.wait(10)

    tokenless = _serve_sim(["--enable-sleep-mode"], {}, free_port())
    out, _ = tokenless.communicate(timeout=20)
    assert tokenless.returncode != 0
    assert b"--enable-sleep-mode requires a secret in TENSORFOLD_SLEEP_TOKEN" in out
