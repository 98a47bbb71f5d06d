"""Model sources: HTTP files (checksums, resume, one download for many starts), Hugging
Face repositories from a local Hub endpoint, local paths checked and never touched, and
pruning that removes downloads only."""

from __future__ import annotations

import hashlib
import json
import signal
import threading
from pathlib import Path

import httpx
import pytest

from capyctl.deployments.models import Deployment
from capyctl.deployments.services import remove_deployment
from capyctl.events.models import Event
from capyctl.scheduler import actions, errors, estimates
from hostagent.sources import LOCAL_HINT, SourceCache, SourceError, check_syntax, weights_size
from tests.fakes import FakeHub, FileServer, point_hub_at
from tests.scheduling import SIM, SIM_ENV, deployment

WEIGHTS = bytes(range(256)) * 16_384  # 4 MiB
SHA = hashlib.sha256(WEIGHTS).hexdigest()


@pytest.fixture
def files():
    server = FileServer({"/m/tiny.gguf": WEIGHTS})
    yield server
    server.close()


@pytest.fixture
def hub(monkeypatch):
    server = FakeHub(
        {"acme/tiny": {"config.json": b'{"model_type": "llama"}', "model.safetensors": WEIGHTS}}
    )
    point_hub_at(monkeypatch, server)
    yield server
    server.close()


def gets(server: FileServer, path: str) -> list[str]:
    return [rng for p, rng in server.requests if p == path]


# -- the cache, on its own ------------------------------------------------------------------


def test_an_http_source_downloads_once_and_verifies_its_checksum(files, tmp_path):
    cache = SourceCache(tmp_path)
    source = f"{files.url}/m/tiny.gguf#sha256={SHA}"
    done = cache.fetch(source)
    assert done.state == "done", done.error
    assert Path(done.path).read_bytes() == WEIGHTS
    assert done.size_bytes == len(WEIGHTS)
    assert (done.done_bytes, done.total_bytes, done.downloaded) == (
        len(WEIGHTS),
        len(WEIGHTS),
        True,
    )
    again = cache.fetch(source)
    assert again.state == "done"
    assert again.downloaded is False
    assert len(gets(files, "/m/tiny.gguf")) == 1


def test_concurrent_starts_of_one_source_download_once(files, tmp_path):
    cache = SourceCache(tmp_path)
    source = f"{files.url}/m/tiny.gguf"
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.fetch(source))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {r.state for r in results} == {"done"}
    assert len(gets(files, "/m/tiny.gguf")) == 1
    # Two caches on one directory (two processes) share it through the lock file.
    other = SourceCache(tmp_path).fetch(source)
    assert other.state == "done"
    assert len(gets(files, "/m/tiny.gguf")) == 1


def test_a_wrong_checksum_fails_and_leaves_no_usable_file(files, tmp_path):
    cache = SourceCache(tmp_path)
    wrong = "0" * 64
    failed = cache.fetch(f"{files.url}/m/tiny.gguf#sha256={wrong}")
    assert failed.state == "failed"
    assert failed.error.startswith(f"checksum mismatch for {files.url}/m/tiny.gguf")
    assert f"expected sha256 {wrong}, got {SHA}" in failed.error
    directory = cache.http_dir(f"{files.url}/m/tiny.gguf")
    assert not (directory / "tiny.gguf").exists()
    assert not (directory / "tiny.gguf.part").exists()


def test_an_interrupted_download_resumes_where_it_stopped(files, tmp_path):
    cache = SourceCache(tmp_path)
    source = f"{files.url}/m/tiny.gguf#sha256={SHA}"
    files.cut_after = 1_000_000
    first = cache.fetch(source)
    assert first.state == "failed"
    assert "the next start resumes it" in first.error
    directory = cache.http_dir(f"{files.url}/m/tiny.gguf")
    assert not (directory / "tiny.gguf").exists()  # never mistaken for a complete file
    assert (directory / "tiny.gguf.part").stat().st_size == 1_000_000
    second = cache.fetch(source)
    assert second.state == "done", second.error
    assert gets(files, "/m/tiny.gguf") == ["", "bytes=1000000-"]
    assert Path(second.path).read_bytes() == WEIGHTS


def test_missing_files_and_malformed_sources_say_what_is_wrong(files, tmp_path):
    cache = SourceCache(tmp_path)
    missing = cache.fetch(f"{files.url}/m/nope.gguf")
    assert (missing.state, missing.error) == (
        "failed", f"downloading {files.url}/m/nope.gguf failed: HTTP 404"
    )  # fmt: skip
    local = cache.fetch(str(tmp_path / "absent"))
    assert local.error == f"the local source {tmp_path / 'absent'} does not exist" + LOCAL_HINT
    for bad, words in [
        ("hf://just-a-name", "hf://ORG/NAME"),
        ("https://example.com/", "must name a file"),
        ("https://example.com/a.gguf#md5=1", "#sha256="),
    ]:
        with pytest.raises(SourceError, match=words):
            check_syntax(bad)


def test_a_hugging_face_source_downloads_from_the_hub_endpoint(hub, tmp_path):
    cache = SourceCache(tmp_path)
    done = cache.fetch("hf://acme/tiny")
    assert done.state == "done", done.error
    folder = Path(done.path)
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    assert done.size_bytes == len(WEIGHTS)  # the safetensors total, not config.json
    assert done.downloaded is True
    assert cache.fetch("hf://acme/tiny").downloaded is False  # cached
    missing = cache.fetch("hf://acme/ghost")
    assert missing.state == "failed"
    assert missing.error == (
        f"hf://acme/ghost: no such repository at {hub.url} (or it is private and HF_TOKEN "
        "is missing)"
    )


def test_offline_mode_serves_a_cached_repository_and_refuses_the_rest(hub, tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = SourceCache(tmp_path)
    assert cache.fetch("hf://acme/tiny").state == "done"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub.requests.clear()
    cached = cache.fetch("hf://acme/tiny")
    assert cached.state == "done", cached.error
    assert hub.requests == []
    absent = cache.fetch("hf://acme/other")
    assert absent.state == "failed"
    assert "not in this host's cache" in absent.error


def test_weights_size_counts_safetensors_and_gguf(tmp_path):
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "model-00002.safetensors").write_bytes(b"x" * 50)
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 1000)
    assert weights_size(tmp_path) == 150
    assert weights_size(tmp_path / "tokenizer.json") == 1000
    assert weights_size(tmp_path / "absent") is None


def test_prune_removes_unused_downloads_only(files, hub, tmp_path):
    cache = SourceCache(tmp_path / "cache")
    kept = f"{files.url}/m/tiny.gguf"
    assert cache.fetch(kept).state == "done"
    assert cache.fetch("hf://acme/tiny").state == "done"
    mine = tmp_path / "my-model"
    mine.mkdir()
    (mine / "weights.gguf").write_bytes(b"mine")
    would = cache.prune([kept, str(mine)], dry_run=True)
    assert [s for s, _, _ in would] == ["hf://acme/tiny"]
    assert would[0][2] >= len(WEIGHTS)
    assert Path(would[0][1]).exists()  # a dry run removes nothing
    removed = cache.prune([kept, str(mine)])
    assert [s for s, _, _ in removed] == ["hf://acme/tiny"]
    assert not Path(removed[0][1]).exists()
    assert [s for s, _, _ in cache.downloads()] == [kept]
    assert (mine / "weights.gguf").read_bytes() == b"mine"  # never touched


# -- through the scheduler ------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_model_with_an_http_source_downloads_then_starts(gpu24, files):
    from capyctl.engines.services import add_engine

    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    source = f"{files.url}/m/tiny.gguf#sha256={SHA}"
    model = deployment("tiny", source=source)
    ready = actions.ensure_ready(model.pk)
    assert ready.observed_state == "ready"
    assert ready.source_bytes == len(WEIGHTS)
    assert ready.download["state"] == "done"
    kinds = list(Event.objects.filter(subject="tiny").order_by("id").values_list("kind", flat=True))
    assert kinds.index("deployment.downloading") < kinds.index("deployment.downloaded")
    assert kinds.index("deployment.downloaded") < kinds.index("deployment.ready")
    downloaded = Event.objects.get(subject="tiny", kind="deployment.downloaded")
    assert downloaded.message.startswith(f"downloaded {source}: 4.0 MiB in ")
    # The engine was given the downloaded file, not the URL.
    instance = gpu24.instance(actions.instance_key(ready.instances.get()))
    path = Path(instance.request.source)
    assert path.read_bytes() == WEIGHTS
    assert path.is_relative_to(gpu24.sources.root)
    row = Deployment.objects.get(pk=model.pk)
    assert row.measured_weights_bytes is None  # nothing measured yet: the source's size
    assert estimates.weights_bytes(row, 10**12) == len(WEIGHTS)
    # Stopped and removed: the file stays, and a second deployment reuses it.
    actions.stop(model.pk)
    remove_deployment("tiny")
    assert path.read_bytes() == WEIGHTS
    other = deployment("again", source=source)
    assert actions.ensure_ready(other.pk).observed_state == "ready"
    assert len(gets(files, "/m/tiny.gguf")) == 1


@pytest.mark.django_db(transaction=True)
def test_a_missing_local_source_fails_clearly_and_a_present_one_is_left_alone(gpu24, tmp_path):
    from capyctl.engines.services import add_engine

    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    absent = deployment("absent", source=str(tmp_path / "nowhere"))
    with pytest.raises(errors.SourceError, match="does not exist"):
        actions.ensure_ready(absent.pk)
    row = Deployment.objects.get(pk=absent.pk)
    assert row.observed_state == "failed"
    assert (
        row.state_reason
        == f"the local source {tmp_path / 'nowhere'} does not exist"
        + LOCAL_HINT
        + " (on host local)"
    )
    assert not absent.ledger_entries.exists()  # nothing was admitted, no engine ran
    weights = tmp_path / "mine.gguf"
    weights.write_bytes(b"x" * 1234)
    present = deployment("present", source=str(weights))
    ready = actions.ensure_ready(present.pk)
    assert ready.source_bytes == 1234
    assert ready.measured_weights_bytes is None
    assert estimates.weights_bytes(ready, 10**12) == 1234
    actions.stop(present.pk)
    remove_deployment("present")
    assert weights.read_bytes() == b"x" * 1234
    assert gpu24.prune([], dry_run=False) == []  # a local path is never a download
    assert weights.exists()


@pytest.mark.e2e
def test_the_cli_shows_a_download_and_prunes_it_after_the_model_is_removed(program_env, files):
    from tests.conftest import run_program, start_server, stop_server

    files.seconds_per_mib = 0.5  # 4 MiB in about 2 s: progress to show
    run = lambda *argv: run_program(program_env, *argv)  # noqa: E731
    source = f"{files.url}/m/tiny.gguf#sha256={SHA}"
    assert run("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm").code == 0
    added = run("deployment", "add", "tiny", "--engine", "sim", "--source", source, "--gpus", "0")
    assert added.code == 0, added.err
    bad = run("deployment", "add", "bad", "--engine", "sim", "--gpus", "0",
              "--source", f"{files.url}/m/tiny.gguf#sha256={'0' * 64}")  # fmt: skip
    assert bad.code == 0, bad.err
    server = start_server(program_env)
    try:
        started = run("deployment", "start", "tiny")
        assert started.code == 0, started.err
        assert started.out.startswith("tiny is ready")
        assert "downloading: " in started.err
        assert "downloaded 4.0 MiB of 4.0 MiB" in started.err.splitlines()[-1]
        status = run("status").out
        assert "tiny" in status
        listed = run("cache", "list").out
        assert f"{files.url}/m/tiny.gguf" in listed
        assert "4.0 MiB" in listed
        refused = run("deployment", "start", "bad")
        assert refused.code == 1
        assert "checksum mismatch" in refused.err
        assert "expected sha256 0000" in refused.err
        kept = run("cache", "prune", "--dry-run")
        assert kept.out.strip() == "nothing to remove"  # tiny still names it
        assert run("deployment", "stop", "tiny").code == 0
        assert run("deployment", "remove", "tiny").code == 0
        assert run("deployment", "remove", "bad").code == 0
        would = run("cache", "prune", "--dry-run")
        assert would.out.startswith(f"would remove {files.url}/m/tiny.gguf on local: 4.0 MiB at ")
        assert f"{files.url}/m/tiny.gguf" in run("cache", "list").out  # a dry run keeps it
        pruned = run("cache", "prune")
        assert pruned.out.splitlines()[-1] == "removed 1 download(s), 4.0 MiB"
        assert run("cache", "list").out.strip() == "no downloads"
    finally:
        stop_server(server, signal.SIGTERM)


def test_a_cached_file_is_checked_against_each_sources_checksum(files, tmp_path):
    cache = SourceCache(tmp_path)
    assert cache.fetch(f"{files.url}/m/tiny.gguf#sha256={SHA}").state == "done"
    other = cache.fetch(f"{files.url}/m/tiny.gguf#sha256={'1' * 64}")
    assert other.state == "failed"
    assert other.error.endswith("(the file already in the cache)")
    final = cache.http_dir(f"{files.url}/m/tiny.gguf") / "tiny.gguf"
    assert final.read_bytes() == WEIGHTS  # another source's verified download stays
    assert len(gets(files, "/m/tiny.gguf")) == 1


@pytest.mark.e2e
def test_a_server_downloads_from_the_hub_its_hf_endpoint_names(program_env):
    """HF_ENDPOINT in the server's environment is where hf:// sources come from."""
    from tests.conftest import run_program, start_server, stop_server

    hub = FakeHub({"acme/tiny": {"config.json": b"{}", "model.safetensors": WEIGHTS}})
    program_env["HF_ENDPOINT"] = hub.url
    run = lambda *argv: run_program(program_env, *argv)  # noqa: E731
    try:
        assert run("engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm").code == 0
        for name, source in (("tiny", "hf://acme/tiny"), ("ghost", "hf://acme/ghost")):
            added = run("deployment", "add", name, "--engine", "sim", "--source", source,
                        "--gpus", "0")  # fmt: skip
            assert added.code == 0, added.err
        server = start_server(program_env)
        try:
            started = run("deployment", "start", "tiny")
            assert started.code == 0, started.err
            assert any("/acme/tiny/resolve/" in path for path, _ in hub.requests)
            row = {d["name"]: d for d in json.loads(run("deployment", "list", "--json").out)}
            assert row["tiny"]["source_bytes"] == len(WEIGHTS)
            missing = run("deployment", "start", "ghost")
            assert missing.code == 1
            assert f"hf://acme/ghost: no such repository at {hub.url}" in missing.err
            # On /v1 a model whose weights cannot be had says so, and not to retry.
            key = run("key", "create", "--user", "admin").out.strip()
            asked = httpx.post(
                f"{server.base_url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": "ghost", "messages": [{"role": "user", "content": "hi"}]},
                timeout=60,
            )
            assert asked.status_code == 502
            assert asked.json()["error"]["code"] == "source_failed"
            assert "no such repository" in asked.json()["error"]["message"]
            assert asked.headers["x-should-retry"] == "false"
        finally:
            stop_server(server, signal.SIGTERM)
    finally:
        hub.close()


@pytest.mark.django_db(transaction=True)
def test_a_download_nobody_watches_any_more_is_failed_by_reconcile(gpu24):
    from datetime import timedelta

    from django.utils import timezone

    from capyctl.engines.services import add_engine
    from capyctl.hosts.models import Host
    from capyctl.scheduler.reconcile import reconcile

    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    local = Host.objects.get(name="local")
    old = (timezone.now() - timedelta(minutes=10)).isoformat()
    fresh = timezone.now().isoformat()
    for name, seen in (("orphan", old), ("busy", fresh)):
        row = deployment(name, source=f"https://example.com/{name}.gguf")
        Deployment.objects.filter(pk=row.pk).update(
            observed_state="downloading", host=local, download={"updated_at": seen}
        )
    reconcile(local.pk)
    orphan = Deployment.objects.get(name="orphan")
    assert orphan.observed_state == "failed"
    assert "stopped being watched" in orphan.state_reason
    assert Deployment.objects.get(name="busy").observed_state == "downloading"


@pytest.mark.django_db(transaction=True)
def test_stopping_a_downloading_model_does_not_wait_for_the_download(gpu24, files):
    """The start that downloads holds the model's lock for the whole download; a stop once
    waited for that lock, so for the download (a minute here, hours for real weights)."""
    import time

    from django.db import connection

    from capyctl.engines.services import add_engine
    from tests.waiting import wait_until

    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    files.seconds_per_mib = 15.0  # 4 MiB: about a minute
    model = deployment("slow", source=f"{files.url}/m/tiny.gguf#sha256={SHA}")
    outcome: list[str] = []

    def start() -> None:
        try:
            actions.ensure_ready(model.pk)
            outcome.append("ready")
        except errors.SchedulerError as exc:
            outcome.append(exc.code)
        finally:
            connection.close()

    starter = threading.Thread(target=start)
    starter.start()
    try:
        wait_until(
            lambda: Deployment.objects.get(pk=model.pk).observed_state == "downloading",
            "the download to begin",
        )
        began = time.monotonic()
        stopped = actions.stop(model.pk)
        took = time.monotonic() - began
        assert took < 20, f"the stop took {took:.0f}s: it waited for the download"
        assert stopped.observed_state == "stopped"
        assert stopped.state_reason == f"stopped on request while downloading {model.source}"
        starter.join(timeout=20)
        assert not starter.is_alive()
        assert outcome == ["model_stopped"]
    finally:
        files.seconds_per_mib = 0.0  # the rest of the download, at once
        starter.join(timeout=60)


def _ask_big(key: str) -> httpx.Response:
    """A chat request for ``big`` through the gateway, in this process."""
    from typing import Any, cast

    from asgiref.sync import async_to_sync

    from capyctl.gateway.app import Gateway

    async def ask() -> httpx.Response:
        gateway = Gateway()
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=cast("Any", gateway)),
                base_url="http://testserver", headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            ) as client:  # fmt: skip
                return await client.post("/v1/chat/completions", json={
                    "model": "big", "messages": [{"role": "user", "content": "hi"}],
                })  # fmt: skip
        finally:
            await gateway.close()

    return async_to_sync(ask)()


@pytest.mark.django_db(transaction=True)
def test_a_model_no_gpu_holds_fails_after_its_download_with_that_reason(gpu24, files, bob):
    """A 30 GiB claim, its weights from a URL, on a 24 GiB GPU: it downloads, then no
    room can ever be made. The request is told so at once (503 no_capacity) and the model
    is failed with that reason; it was left `downloading 4.0 MiB of 4.0 MiB` until the
    reconcile failed it two minutes later for a download "no longer watched". The next
    request is refused the same way, with nothing downloaded again."""
    from capyctl.access.services import issue_api_key
    from capyctl.engines.services import add_engine

    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    model = deployment("big", gib=30, source=f"{files.url}/m/tiny.gguf#sha256={SHA}")
    key = issue_api_key("bob")[1]
    why = "big needs 30.0 GiB per GPU; the largest GPU pool holds 24.0 GiB"
    for _ in range(2):
        answer = _ask_big(key)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "no_capacity"
        assert answer.json()["error"]["message"] == why
        assert answer.headers["x-should-retry"] == "false"
        row = Deployment.objects.get(pk=model.pk)
        assert (row.observed_state, row.state_reason) == ("failed", why)
        assert not row.ledger_entries.exists()
    assert row.download["state"] == "done"  # its weights stay fetched
    assert len(gets(files, "/m/tiny.gguf")) == 1
    failures = Event.objects.filter(subject="big", kind="deployment.failed")
    assert list(failures.values_list("message", flat=True)) == [f"big failed: {why}"] * 2


@pytest.mark.django_db(transaction=True)
def test_any_error_after_a_download_ends_the_state_with_its_own_reason(gpu24, files):
    """The start's own database write after the download is refused (the database says
    so): the model does not stay `downloading` but fails with what the database said."""
    from capyctl.deployments.models import Instance
    from capyctl.engines.services import add_engine
    from tests.refusals import refused

    add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)
    model = deployment("big", gib=8, source=f"{files.url}/m/tiny.gguf#sha256={SHA}")
    with refused(Instance._meta.db_table, "INSERT"), pytest.raises(Exception, match="refused"):
        actions.ensure_ready(model.pk)
    row = Deployment.objects.get(pk=model.pk)
    assert row.observed_state == "failed"
    assert row.state_reason.startswith("the start failed after its download: ")
    assert row.state_reason.endswith("refused by the database")
    assert not row.ledger_entries.exists()
    assert actions.ensure_ready(model.pk).observed_state == "ready"  # the next start
    assert len(gets(files, "/m/tiny.gguf")) == 1
