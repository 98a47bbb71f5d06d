"""What a /v1 request may ask of a deployment's engine, held at the gateway.

- Ceilings: a key that may make one request at a time could still ask an engine for
  100,000 answers of 2^31 tokens each. Each deployment has ceilings on ``max_tokens`` (and
  ``max_completion_tokens``, ``max_output_tokens``), ``n`` and ``best_of``; a request past
  one, or with a value that is no whole number, is refused with 400 naming the field (and
  the ceiling) before it reaches the engine or wakes the model. Only staff set them.
- Media: engines fetch the image, audio and video URLs a body names, from the GPU host. By
  default only ``data:`` URLs pass; a deployment's media domains let their hosts' http(s)
  URLs through, and nothing else.

Against a running standalone server with simulated vLLM engines, as a client would."""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psutil
import pytest

from capyctl.deployments.models import Deployment
from capyctl.deployments.services import DeploymentSpec, add_deployment
from capyctl.engines.services import add_engine
from tests.conftest import (
    CliResult,
    Server,
    program_environment,
    run_program,
    run_programs,
    start_server,
    stop_server,
)
from tests.test_media_fetch import serving_media
from tests.test_user_ceilings import log_in

SIM = f"{sys.executable} -m hostagent.sim"


class Site:
    def __init__(
        self, server: Server, key: str, env: dict[str, str], passwords: dict[str, str]
    ) -> None:
        self.server = server
        self.key = key
        self.env = env
        self.passwords = passwords

    def run(self, *argv: str) -> CliResult:
        return run_program(self.env, *argv)

    def post(self, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(f"{self.server.base_url}{path}", headers=headers, content=content,
                          timeout=60)  # fmt: skip

    def chat(self, model: str, **extra: Any) -> httpx.Response:
        messages = [{"role": "user", "content": "hi"}]
        return self.post("/v1/chat/completions", {"model": model, "messages": messages, **extra})

    def deployment(self, name: str) -> dict[str, Any]:
        rows = json.loads(self.run("deployment", "list", "--json").out)
        return next(row for row in rows if row["name"] == name)


@pytest.fixture
def media_host() -> Iterator[tuple[int, list[str]]]:
    with serving_media() as served:
        yield served


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """One server for the module (each test uses models of its own): chat, plain and
    knobs with every default, tight (low ceilings) and pics (media from 127.0.0.1), on
    simulated vLLM; staff alice, and bob, who is not staff."""
    tmp = tmp_path_factory.mktemp("guards")
    with program_environment(tmp / "data") as env:
        env["CAPYCTL_SIM_GPUS"] = "24GiB"
        env["CAPYCTL_MIN_READY_SECONDS"] = "0"
        add = ["--engine", "sim", "--source", "m", "--gpu-memory", "4GiB"]
        low = ["--max-tokens-ceiling", "100", "--n-ceiling", "2", "--best-of-ceiling", "3"]
        setup = [
            ["engine", "add", "sim", "--kind", "vllm", "--command", f"{SIM} vllm"],
            *(["deployment", "add", name, *add] for name in ("chat", "plain")),
            *(["deployment", "add", name, *add, *low] for name in ("tight", "knobs")),
            ["deployment", "add", "pics", *add, "--media-domains", "127.0.0.1"],
            ["key", "create", "--user", "admin"],
            ["user", "add", "alice", "--staff"],
            ["user", "add", "bob"],
        ]
        results = run_programs(env, *setup)
        for argv, result in zip(setup, results, strict=True):
            assert result.code == 0, (argv, result.err)
        passwords = {"alice": password_in(results[-2].out), "bob": password_in(results[-1].out)}
        server = start_server(env)
        try:
            yield Site(server, results[-3].out.strip(), env, passwords)
        finally:
            stop_server(server, signal.SIGTERM)


def password_in(printed: str) -> str:
    """The password ``capyctl user add`` printed (``password: X  (shown only now)``)."""
    return printed.split("password: ", 1)[1].split(maxsplit=1)[0]


def refused(answer: httpx.Response, param: str, *words: str) -> dict[str, Any]:
    """The OpenAI-shaped 400 naming ``param``, whose message says each of ``words``."""
    assert answer.status_code == 400, answer.text
    error: dict[str, Any] = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    assert answer.headers["x-should-retry"] == "false"
    return error


def test_default_ceilings_refuse_what_one_request_could_ask_of_an_engine(site):
    # 100,000 answers, 2^31 tokens: refused before the model is even started.
    refused(site.chat("chat", n=100000), "n", "'n'", "100000", "ceiling of 16")
    refused(site.chat("chat", max_tokens=2**31), "max_tokens", "ceiling of 65536")
    refused(site.chat("chat", max_completion_tokens=2**31), "max_completion_tokens", "65536")
    completion = {"model": "chat", "prompt": "hi", "best_of": 100000, "n": 1}
    refused(site.post("/v1/completions", completion), "best_of", "ceiling of 16")
    assert site.deployment("chat")["observed_state"] == "stopped"  # no start for any of them

    assert site.chat("chat").status_code == 200  # a field left out: the engine's default
    assert site.chat("chat", n=16, max_tokens=65536).status_code == 200
    listed = site.deployment("chat")
    assert (listed["max_tokens_ceiling"], listed["n_ceiling"], listed["best_of_ceiling"]) == (
        65536, 16, 16)  # fmt: skip


def test_each_field_is_held_to_its_deployments_own_ceiling(site):
    for fields in ({"max_tokens": 100}, {"max_completion_tokens": 100}, {"n": 2},
                   {"max_tokens": None, "n": None}):  # fmt: skip
        answer = site.chat("tight", **fields)
        assert answer.status_code == 200, (fields, answer.text)
    refused(site.chat("tight", max_tokens=101), "max_tokens", "101", "ceiling of 100")
    refused(site.chat("tight", max_completion_tokens=101), "max_completion_tokens", "100")
    refused(site.chat("tight", n=3), "n", "ceiling of 2")
    responses = {"model": "tight", "input": "hi", "max_output_tokens": 101}
    refused(site.post("/v1/responses", responses), "max_output_tokens", "ceiling of 100")
    completion = {"model": "tight", "prompt": "hi"}
    assert site.post("/v1/completions", {**completion, "best_of": 3}).status_code == 200
    refused(site.post("/v1/completions", {**completion, "best_of": 4}), "best_of", "of 3")
    # Not a whole number of at least 0: refused whatever the ceiling.
    for bad in ("5", 2.5, -1, True, [1], {"n": 1}, 1e20):
        refused(site.chat("tight", n=bad), "n", "whole number")
        refused(site.chat("chat", max_tokens=bad), "max_tokens", "whole number")


def test_only_staff_set_ceilings_and_a_bad_one_changes_nothing(site):
    bob = log_in(site.server, "bob", site.passwords["bob"])
    widening: list[dict[str, Any]] = [{"n_ceiling": 100000}, {"max_tokens_ceiling": 2**31 - 1},
                                      {"best_of_ceiling": 1000},
                                      {"media_domains": ["169.254.169.254"]}]  # fmt: skip
    for change in widening:
        assert bob.patch("/api/deployments/knobs/", json=change).status_code == 403, change
    before = site.deployment("knobs")
    assert (before["n_ceiling"], before["media_domains"]) == (2, [])

    alice = log_in(site.server, "alice", site.passwords["alice"])
    wrong: list[tuple[dict[str, Any], str]] = [
        ({"n_ceiling": 0}, "n_ceiling"), ({"n_ceiling": "many"}, "n_ceiling"),
        ({"max_tokens_ceiling": 2**31}, "max_tokens_ceiling"),
        ({"media_domains": ["*.example.com"]}, "media_domains"),
        ({"media_domains": ["http://x.example/"]}, "media_domains")]  # fmt: skip
    for change, field in wrong:
        answer = alice.patch("/api/deployments/knobs/", json=change)
        assert answer.status_code == 400, (change, answer.text)
        assert field in answer.json(), answer.text
    tries = [["deployment", "update", "knobs", *argv] for argv in (
        ["--n-ceiling", "0"], ["--n-ceiling", "two"], ["--n-ceiling", str(2**31)],
        ["--media-domains", "evil.example:80"], [])]  # fmt: skip
    for argv, bad in zip(tries, run_programs(site.env, *tries), strict=True):
        assert bad.code != 0, argv
        assert len(bad.err.strip().splitlines()) == 1, (argv, bad.err)
        assert "Traceback" not in bad.err
    assert site.deployment("knobs") == before

    raised = alice.patch("/api/deployments/knobs/", json={"n_ceiling": 8})
    assert raised.status_code == 200, raised.text
    assert raised.json()["n_ceiling"] == 8
    deadline = time.monotonic() + 10  # the gateway's routing table re-reads within a second
    while (answer := site.chat("knobs", n=5)).status_code != 200:
        assert time.monotonic() < deadline, answer.text
        time.sleep(0.2)
    changed = site.run("deployment", "update", "knobs", "--n-ceiling", "3",
                       "--max-tokens-ceiling", "50")  # fmt: skip
    assert changed.code == 0, changed.err
    after = site.deployment("knobs")
    assert (after["n_ceiling"], after["max_tokens_ceiling"], after["best_of_ceiling"]) == (3, 50, 3)


def image_chat(site: Site, model: str, url: str) -> httpx.Response:
    content = [{"type": "text", "text": "what is in it?"},
               {"type": "image_url", "image_url": {"url": url}}]  # fmt: skip
    messages = [{"role": "user", "content": content}]
    return site.post("/v1/chat/completions", {"model": model, "messages": messages})


def test_media_urls_pass_only_as_data_or_from_the_deployments_media_domains(site, media_host):
    port, hits = media_host
    inside = f"http://127.0.0.1:{port}/latest/meta-data/"
    error = refused(image_chat(site, "plain", inside), "messages[0].content[1].image_url.url",
                    "media policy", "media_domains", "only data: URLs")  # fmt: skip
    assert error["code"] == "media_url_not_allowed"
    # Other shapes and spellings of the same ask.
    audio = {"role": "user", "content": [{"audio_url": inside}]}
    refused(site.post("/v1/chat/completions", {"model": "plain", "messages": [audio]}),
            "messages[0].content[0].audio_url")  # fmt: skip
    # Written with JSON escapes, so that no "url" is in its bytes.
    escaped = (b'{"model": "plain", "messages": [{"role": "user", "content": [{'
               b'"\\u0069mage_\\u0075rl": {"\\u0055RL": "' + inside.encode()
               + b'"}}]}]}')  # fmt: skip
    assert b"url" not in escaped.lower()
    refused(site.post("/v1/chat/completions", escaped), "messages[0].content[0].image_url.URL")
    image = {"type": "input_image", "image_url": inside}
    responses = {"model": "plain", "input": [{"role": "user", "content": [image]}]}
    refused(site.post("/v1/responses", responses), "input[0].content[0].image_url")
    for other in ("file:///etc/passwd", "/etc/passwd", f"http://127.0.0.1:{port}@evil.example/",
                  f"gopher://127.0.0.1:{port}/"):  # fmt: skip
        refused(image_chat(site, "plain", other), "messages[0].content[1].image_url.url")
    assert site.deployment("plain")["observed_state"] == "stopped"  # none reached an engine
    answer = image_chat(site, "plain", "data:image/png;base64,iVBORw0KGgo=")
    assert answer.status_code == 200, answer.text

    # pics lists 127.0.0.1: its URLs reach the engine, which fetches them.
    answer = image_chat(site, "pics", f"http://127.0.0.1:{port}/cat.png")
    assert answer.status_code == 200, answer.text
    refused(image_chat(site, "pics", f"http://localhost:{port}/cat.png"),
            "messages[0].content[1].image_url.url",
            "only data: URLs and http(s) URLs on 127.0.0.1")  # fmt: skip
    refused(image_chat(site, "pics", inside.replace("http://", "ftp://")),
            "messages[0].content[1].image_url.url")  # fmt: skip
    assert hits == ["/cat.png"]
    # CapyCTL launched pics's engine to fetch from its media domains alone.
    argv = engine_command_line(site.server, "pics")
    given = argv[argv.index("--allowed-media-domains") + 1 :]
    assert given[: next(i for i, a in enumerate([*given, "--"]) if a.startswith("--"))] == [
        "127.0.0.1"
    ]


def engine_command_line(server: Server, model: str) -> list[str]:
    """The command line of the engine the server launched for ``model``, as ``ps`` shows it."""
    for process in psutil.Process(server.process.pid).children(recursive=True):
        argv = process.cmdline()
        if "--served-model-name" in argv and argv[argv.index("--served-model-name") + 1] == model:
            return list(argv)
    raise AssertionError(f"no engine runs for {model}")


@pytest.mark.django_db
def test_the_admin_sets_ceilings_and_media_domains_and_refuses_bad_ones_on_the_field(client, alice):
    alice.is_superuser = True
    alice.save()
    client.force_login(alice)
    engine = add_engine("sim", kind="vllm", command="python -m hostagent.sim vllm")
    llama = add_deployment(DeploymentSpec(name="llama", engine="sim", source="/m/llama"))
    url = f"/admin/deployments/deployment/{llama.pk}/change/"
    form = {"name": "llama", "engine": engine.pk, "source": "/m/llama", "gpus": 1,
            "park": "auto", "priority": 0, "over_claim": "stop"}  # fmt: skip
    for bad, field in (({"n_ceiling": "0"}, "n_ceiling"),
                       ({"max_tokens_ceiling": str(2**31)}, "max_tokens_ceiling"),
                       ({"media_domains": "*.example.com"}, "media_domains")):  # fmt: skip
        page = client.post(url, {**form, **bad})
        assert page.status_code == 200, bad  # the form again, with the error on its field
        assert field in str(page.context["adminform"].form.errors), bad
    assert Deployment.objects.get(pk=llama.pk).ceilings == {
        "max_tokens_ceiling": 65536, "n_ceiling": 16, "best_of_ceiling": 16}  # fmt: skip
    domains = "Images.Example.com, cdn.example.com"
    saved = client.post(url, {**form, "n_ceiling": "4", "best_of_ceiling": "2",
                              "media_domains": domains})  # fmt: skip
    assert saved.status_code == 302, saved.content.decode()[:2000]
    llama = Deployment.objects.get(pk=llama.pk)
    assert (llama.n_ceiling, llama.best_of_ceiling, llama.max_tokens_ceiling) == (4, 2, 65536)
    assert llama.media_domains == ["images.example.com", "cdn.example.com"]
