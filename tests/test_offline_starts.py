"""Engines start offline: a bare Hugging Face id is fetched by CapyCTL (progress, cache,
sizes) and the engine is given the snapshot folder with HF_HUB_OFFLINE=1; vLLM's usage
reports and TensorFold's update check are off; an engine whose ``engine_downloads``
option is true is left to download such names itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from capyctl.deployments.models import Deployment
from capyctl.engines.services import add_engine
from capyctl.events.models import Event
from capyctl.scheduler import actions, errors
from hostagent.kinds import KindError, get_kind
from hostagent.kinds.base import LaunchSpec
from hostagent.sources import engine_source
from tests.fakes import FakeHub, point_hub_at, process_environ
from tests.scheduling import SIM, SIM_ENV, deployment

WEIGHTS = bytes(range(256)) * 8_192  # 2 MiB
REPO = "acme/tiny"


@pytest.fixture
def hub(monkeypatch):
    server = FakeHub(
        {REPO: {"config.json": b'{"model_type": "llama"}', "model.safetensors": WEIGHTS}}
    )
    point_hub_at(monkeypatch, server)
    yield server
    server.close()


def _spec(**extra) -> LaunchSpec:
    return LaunchSpec(command="engine", source="/m", served_name="chat", port=41000,
                      api_key="k", **extra)  # fmt: skip


# -- what is fetched, and what the engine is told ---------------------------------------------


@pytest.mark.parametrize("kind", ["vllm", "sglang", "tensorfold"])
def test_a_bare_hub_id_is_fetched_for_engines_that_would_download_it(kind):
    assert engine_source("Qwen/Qwen2.5-7B-Instruct", kind, {}) == "hf://Qwen/Qwen2.5-7B-Instruct"
    assert engine_source(REPO, kind, {"engine_downloads": False}) == f"hf://{REPO}"
    # The operator's opt-out, and what is no bare id, stay as they are.
    assert engine_source(REPO, kind, {"engine_downloads": True}) == REPO
    for same in ("chat", "/models/qwen", "./qwen", "hf://acme/tiny@main", "a/b/c", "a/..b",
                 "https://example.com/m/tiny.gguf"):  # fmt: skip
        assert engine_source(same, kind, {}) == same


@pytest.mark.parametrize("kind", ["llamacpp", "custom"])
def test_llama_cpp_and_custom_engines_keep_their_sources(kind):
    assert engine_source(REPO, kind, {}) == REPO


def test_each_kind_starts_its_engine_off_the_network():
    vllm = get_kind("vllm").build_launch(_spec())
    assert {k: vllm.env.get(k) for k in ("HF_HUB_OFFLINE", "VLLM_NO_USAGE_STATS",
                                         "VLLM_DO_NOT_TRACK")} == dict.fromkeys(
        ("HF_HUB_OFFLINE", "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK"), "1"
    )  # fmt: skip
    tensorfold = get_kind("tensorfold").build_launch(_spec())
    assert tensorfold.env["TENSORFOLD_NO_UPDATE_CHECK"] == "1"
    assert tensorfold.env["HF_HUB_OFFLINE"] == "1"
    # The variable, not the flag: a release without the check would exit on the flag.
    assert "--no-update-check" not in tensorfold.argv
    sglang = get_kind("sglang").build_launch(_spec(run_dir=Path("/tmp")))  # noqa: S108 - no file is written
    assert sglang.env["HF_HUB_OFFLINE"] == "1"
    llama = get_kind("llamacpp").build_launch(_spec())
    assert "HF_HUB_OFFLINE" not in llama.env  # a GGUF file path: nothing to look up
    # The opt-out leaves the Hub to the engine; the update check and usage reports stay off.
    left = get_kind("tensorfold").build_launch(_spec(options={"engine_downloads": True}))
    assert "HF_HUB_OFFLINE" not in left.env
    assert left.env["TENSORFOLD_NO_UPDATE_CHECK"] == "1"
    # The engine's own env still decides for itself.
    own = get_kind("vllm").build_launch(_spec(env={"VLLM_NO_USAGE_STATS": "0"}))
    assert own.env["VLLM_NO_USAGE_STATS"] == "0"


def test_engine_downloads_is_a_yes_or_no_for_the_kinds_that_have_it():
    get_kind("vllm").check_options({"engine_downloads": True})
    get_kind("tensorfold").check_options({"engine_downloads": False})
    with pytest.raises(KindError, match=r"^the engine option engine_downloads is true or false"):
        get_kind("sglang").check_options({"engine_downloads": "yes"})
    with pytest.raises(KindError, match=r"^vllm takes only engine_downloads \(got other\)"):
        get_kind("vllm").check_options({"engine_downloads": True, "other": 1})
    with pytest.raises(KindError, match=r"^llamacpp takes no engine options"):
        get_kind("llamacpp").check_options({"engine_downloads": True})


# -- through the scheduler, with simulated engines --------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kind", ["vllm", "tensorfold"])
def test_a_bare_hub_id_is_downloaded_by_capyctl_and_the_engine_starts_offline(gpu24, hub, kind):
    add_engine("sim", kind=kind, command=f"{SIM} {kind}", env=SIM_ENV)
    model = deployment("tiny", engine="sim", source=REPO)
    ready = actions.ensure_ready(model.pk)
    assert ready.observed_state == "ready"
    assert any(f"/{REPO}/resolve/" in path for path, _ in hub.requests)
    assert ready.download["state"] == "done"
    assert ready.source_bytes == len(WEIGHTS)
    kinds = list(Event.objects.filter(subject="tiny").order_by("id").values_list("kind", flat=True))
    assert kinds.index("deployment.downloading") < kinds.index("deployment.downloaded")
    assert kinds.index("deployment.downloaded") < kinds.index("deployment.ready")
    downloaded = Event.objects.get(subject="tiny", kind="deployment.downloaded")
    assert downloaded.message.startswith(f"downloaded {REPO}: 2.0 MiB in ")
    # The engine was given the snapshot folder in this host's cache, under its own name.
    instance = gpu24.instance(actions.instance_key(ready.instances.get()))
    folder = Path(instance.request.source)
    assert folder.is_relative_to(gpu24.sources.root)
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    assert instance.request.served_name == "tiny"
    seen = process_environ(instance.pid)
    assert seen["HF_HUB_OFFLINE"] == "1"
    if kind == "tensorfold":
        assert seen["TENSORFOLD_NO_UPDATE_CHECK"] == "1"
    else:
        assert (seen["VLLM_NO_USAGE_STATS"], seen["VLLM_DO_NOT_TRACK"]) == ("1", "1")
    # The next start finds it in the cache: no second download.
    actions.stop(model.pk)
    again = actions.start(model.pk)
    assert again.observed_state == "ready"
    assert again.download["downloaded"] is False
    assert Event.objects.filter(subject="tiny", kind="deployment.downloaded").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_missing_hub_id_fails_clearly_before_any_engine_runs(gpu24, hub):
    add_engine("sim", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    model = deployment("ghost", engine="sim", source="acme/ghost")
    with pytest.raises(errors.SourceError, match="no such repository"):
        actions.ensure_ready(model.pk)
    row = Deployment.objects.get(pk=model.pk)
    assert row.observed_state == "failed"
    assert row.state_reason.startswith(f"hf://acme/ghost: no such repository at {hub.url}")
    assert not row.instances.exists()


@pytest.mark.django_db(transaction=True)
def test_engine_downloads_leaves_the_bare_id_to_the_engine(gpu24, hub):
    add_engine("sim", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV,
               options={"engine_downloads": True})  # fmt: skip
    model = deployment("tiny", engine="sim", source=REPO)
    ready = actions.ensure_ready(model.pk)
    assert ready.observed_state == "ready"
    assert hub.requests == []  # CapyCTL fetched nothing
    assert not Event.objects.filter(subject="tiny", kind="deployment.downloading").exists()
    instance = gpu24.instance(actions.instance_key(ready.instances.get()))
    assert instance.request.source == REPO
    seen = process_environ(instance.pid)
    assert "HF_HUB_OFFLINE" not in seen
    assert seen["VLLM_NO_USAGE_STATS"] == "1"  # usage reports stay off either way


@pytest.mark.e2e
def test_the_cli_shows_a_bare_ids_download_and_keeps_it_in_the_cache(program_env):
    import signal

    from tests.conftest import run_program, start_server, stop_server

    hub = FakeHub({REPO: {"config.json": b"{}", "model.safetensors": WEIGHTS}})
    hub.seconds_per_mib = 1.0  # 2 MiB in about 2 s: progress to show
    program_env["HF_ENDPOINT"] = hub.url
    run = lambda *argv: run_program(program_env, *argv)  # noqa: E731
    try:
        assert run("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm").code == 0
        added = run("deployment", "add", "tiny", "--engine", "sim", "--source", REPO,
                    "--gpus", "0")  # fmt: skip
        assert added.code == 0, added.err
        server = start_server(program_env)
        try:
            started = run("deployment", "start", "tiny")
            assert started.code == 0, started.err
            assert started.out.startswith("tiny is ready")
            assert "downloaded 2.0 MiB of 2.0 MiB" in started.err.splitlines()[-1]
            assert any(f"/{REPO}/resolve/" in path for path, _ in hub.requests)
            events = run("events").out
            assert f"deployment.downloading   downloading {REPO} to local" in events
            assert f"deployment.downloaded    downloaded {REPO}: 2.0 MiB in " in events
            assert f"hf://{REPO}" in run("cache", "list").out
            # The deployment names it, though not as hf://: a prune keeps it.
            assert run("cache", "prune", "--dry-run").out.strip() == "nothing to remove"
        finally:
            stop_server(server, signal.SIGTERM)
    finally:
        hub.close()
