"""Engines get only what they need: an allowlisted environment, a loopback address they
cannot leave, and engine args that cannot override the flags CapyCTL sets."""

from __future__ import annotations

import re
import signal

import psutil
import pytest
from rest_framework.test import APIClient

from capyctl.deployments.models import Deployment
from capyctl.engines.models import Engine
from capyctl.engines.services import add_engine
from capyctl.scheduler import actions, errors
from hostagent.kinds import KindError, get_kind
from tests.conftest import run_program, start_server, stop_server
from tests.fakes import process_environ
from tests.scheduling import SIM, SIM_ENV, deployment

EVERY_INTERFACE = "0.0.0.0"  # noqa: S104 - what the attacks ask for


def _sim_engines(server_pid: int) -> list[psutil.Process]:
    return [
        child
        for child in psutil.Process(server_pid).children(recursive=True)
        if "hostagent.sim" in " ".join(child.cmdline())
    ]


@pytest.mark.e2e
def test_an_engine_sees_only_the_allowed_environment(program_env):
    program_env |= {
        "CAPYCTL_TEST_SECRET": "hunter2",
        "PGPASSWORD": "x-db-password",
        "AWS_SECRET_ACCESS_KEY": "aws-secret",
        "HF_TOKEN": "hf_for_downloads",
        "LC_ALL": "C.UTF-8",
    }
    run = lambda *argv: run_program(program_env, *argv)  # noqa: E731
    added = run("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm",
                "--env", "OMP_NUM_THREADS=3")  # fmt: skip
    assert added.code == 0, added.err
    assert (
        run("deployment", "add", "m", "--engine", "sim", "--source", "m", "--gpus", "0").code == 0
    )
    server = start_server(program_env)
    try:
        started = run("deployment", "start", "m")
        assert started.code == 0, started.err
        (engine,) = _sim_engines(server.process.pid)
        seen = process_environ(engine.pid)
    finally:
        stop_server(server, signal.SIGTERM)
    for secret in ("CAPYCTL_TEST_SECRET", "PGPASSWORD", "AWS_SECRET_ACCESS_KEY"):
        assert secret not in seen
    assert "hunter2" not in " ".join(seen.values())
    assert seen["PATH"] == program_env["PATH"]
    assert seen["HF_TOKEN"] == "hf_for_downloads"  # engines download from the Hub too
    assert seen["LC_ALL"] == "C.UTF-8"
    assert seen["OMP_NUM_THREADS"] == "3"  # the engine's own --env
    assert seen["VLLM_SERVER_DEV_MODE"] == "1"  # what the kind sets
    assert not [name for name in seen if name.startswith("CAPYCTL_") and "_SIM_" not in name]


# -- a custom template must say where to listen ---------------------------------------------


@pytest.mark.django_db
def test_a_custom_template_without_host_is_refused_by_the_cli_and_rest(cli, alice):
    refused = cli("engine", "add", "c1", "--kind", "custom", "--command",
                  "my-server --port {port} --key-file {api_key_file}")  # fmt: skip
    assert refused.code == 2
    assert refused.err.strip().splitlines()[-1] == (
        "capyctl: error: invalid command template "
        "'my-server --port {port} --key-file {api_key_file}': "
        "it must contain {host} so the server listens on 127.0.0.1 only"
    )
    client = APIClient()
    client.force_login(alice)
    answer = client.post("/api/engines/", {"name": "c2", "kind": "custom",
                         "command": "my-server --port {port}"}, format="json")  # fmt: skip
    assert answer.status_code == 400
    assert "must contain {host}" in str(answer.json()["command"])
    assert not Engine.objects.exists()
    fine = cli("engine", "add", "c3", "--kind", "custom", "--command",
               "my-server --listen {host}:{port}")  # fmt: skip
    assert fine.code == 0, fine.err


# -- an engine that listens beyond loopback is stopped --------------------------------------


@pytest.mark.django_db(transaction=True)
def test_an_engine_listening_on_every_interface_is_stopped_with_the_reason(gpu24):
    # {host} is in the template, but the server ignores it and binds 0.0.0.0.
    add_engine("open", kind="custom", env=SIM_ENV, command=(
        f"{SIM} llamacpp -m {{source}} --port {{port}} --api-key-file {{api_key_file}} "
        "--host 0.0.0.0 --slot-save-path {host}"))  # fmt: skip
    model = deployment("exposed", engine="open")
    with pytest.raises(errors.EngineFailedError, match=re.escape(EVERY_INTERFACE)):
        actions.ensure_ready(model.pk)
    row = Deployment.objects.get(pk=model.pk)
    assert row.observed_state == "failed"
    assert "listens on 0.0.0.0:" in row.state_reason
    assert "127.0.0.1 and ::1 only" in row.state_reason
    assert gpu24.instances() == []  # stopped, not left serving the network
    assert not [
        proc for proc in psutil.process_iter(["cmdline"])
        if "--slot-save-path" in (proc.info["cmdline"] or [])
        and proc.status() != psutil.STATUS_ZOMBIE
    ]  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_an_engine_on_loopback_passes_the_check(gpu24):
    template = (
        f"{SIM} llamacpp -m {{source}} --host {{host}} --port {{port}} "
        "--api-key-file {api_key_file}"
    )
    add_engine("closed", kind="custom", env=SIM_ENV, command=template)
    model = deployment("private", engine="closed")
    assert actions.ensure_ready(model.pk).observed_state == "ready"
    actions.stop(model.pk)


# -- engine args cannot override the reserved flags -----------------------------------------


@pytest.mark.parametrize(
    ("kind", "args", "flag"),
    [
        ("vllm", ["--host", EVERY_INTERFACE], "--host"),
        ("vllm", ["--host=" + EVERY_INTERFACE], "--host"),
        ("vllm", ["--ho", EVERY_INTERFACE], "--host"),  # argparse takes a unique prefix
        ("vllm", ["--ho=" + EVERY_INTERFACE], "--host"),
        ("vllm", ["--po=9000"], "--port"),
        ("vllm", ["--api-k", "mine"], "--api-key"),
        ("vllm", ["--api_key=mine"], "--api-key"),  # vLLM reads _ as -
        ("vllm", ["--served", "other"], "--served-model-name"),
        ("sglang", ["--model", "/other"], "--model-path"),
        ("sglang", ["--enable-weights-cpu=1"], "--enable-weights-cpu-backup"),
        ("tensorfold", ["--na", "x"], "--name"),
        ("llamacpp", ["--alias=x"], "--alias"),
        ("llamacpp", ["--hos", EVERY_INTERFACE], "--host"),
    ],
)
def test_reserved_flags_are_refused_in_every_form(kind, args, flag):
    with pytest.raises(KindError) as info:
        get_kind(kind).check_args(["--max-model-len", "4096", *args])
    assert str(info.value).startswith(f"engine args may not set {flag}")
    assert args[0].split("=", 1)[0] in str(info.value)


def test_flags_that_only_share_a_start_with_reserved_ones_pass():
    get_kind("vllm").check_args(["--hostname-note", "x", "--portable", "--max-model-len=4096"])
    get_kind("llamacpp").check_args(["-c", "2048", "-mg", "0", "--model-url", "x"])
    get_kind("sglang").check_args(["--mem-fraction-static", "0.5"])
