"""Engines fetch the media URLs a chat names, from the GPU host: CapyCTL launches vLLM
and SGLang so that they fetch only from the deployment's media domains (none by default).

A small HTTP server here records every request that reaches it, so each test sees whether
a request made the engine reach out."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest

from hostagent.kinds import get_kind
from hostagent.kinds.base import KindError
from hostagent.probe import SimulatedProbe
from hostagent.runtime import EngineRuntime, Instance, InstanceRequest
from hostagent.simgpu import SimSpec
from tests.test_engine_runtime import SIM

PNG = bytes.fromhex("89504e470d0a1a0a")  # a PNG's signature is all the simulators read


@contextlib.contextmanager
def serving_media() -> Iterator[tuple[int, list[str]]]:
    """A media host on 127.0.0.1: its port, and the paths asked of it."""
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], hits
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def media_host() -> Iterator[tuple[int, list[str]]]:
    with serving_media() as served:
        yield served


Launch = Callable[..., Instance]


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launch]:
    runtime = EngineRuntime(SimulatedProbe(SimSpec(unified=False, sizes=[]), tmp_path / "sim"),
                            tmp_path / "logs")  # fmt: skip
    instances: list[Instance] = []

    def start(kind: str, media_domains: list[str] | None) -> Instance:
        request = InstanceRequest(
            instance_id=f"{kind}-{uuid.uuid4().hex[:6]}",
            kind=kind,
            command=f"{SIM} {kind}",
            source=f"/models/{kind}",
            served_name="pics",
            gpu_indices=[],
            media_domains=media_domains,
        )
        instance = runtime.launch(request)
        instances.append(instance)
        runtime.wait_ready(instance, timeout=30)
        return instance

    yield start
    for instance in instances:
        runtime.stop(instance, grace_seconds=2)


def command_line(instance: Instance) -> list[str]:
    """The engine's arguments, as ``ps`` shows them."""
    return list(psutil.Process(instance.pid).cmdline())


def ask_about(instance: Instance, url: str) -> tuple[int, str]:
    """A chat about the image at ``url``, straight to the engine with its launch key (as
    a local user who found the key, or a gateway that let the URL through)."""
    content = [
        {"type": "text", "text": "what is in it?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    answer = instance.client.request(
        "POST",
        "/v1/chat/completions",
        json={"model": "pics", "messages": [{"role": "user", "content": content}]},
        expect=(200, 400),
    )
    return answer.status_code, answer.text


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_an_engine_with_no_media_policy_fetches_any_url_it_is_given(launch, media_host, kind):
    port, hits = media_host
    engine = launch(kind, None)  # as launched before media policies: no flag
    assert "--allowed-media-domains" not in command_line(engine)
    status, text = ask_about(engine, f"http://127.0.0.1:{port}/internal/secret.png")
    assert status == 200, text
    assert hits == ["/internal/secret.png"]  # the GPU host reached out where it was told


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_engines_are_launched_to_fetch_only_from_the_deployments_media_domains(
    launch, media_host, kind
):
    port, hits = media_host
    closed = launch(kind, [])  # the default policy: no media domains
    argv = command_line(closed)
    flag = argv.index("--allowed-media-domains")
    assert argv[flag + 1 :][:1] == ["media.invalid"]  # a name that never resolves
    status, text = ask_about(closed, f"http://127.0.0.1:{port}/cat.png")
    assert status == 400, text
    assert "allowed domains" in text
    assert ask_about(closed, "data:image/png;base64,iVBORw0KGgo=")[0] == 200
    assert hits == []

    opened = launch(kind, ["127.0.0.1"])
    argv = command_line(opened)
    assert argv[argv.index("--allowed-media-domains") + 1] == "127.0.0.1"
    assert ask_about(opened, f"http://127.0.0.1:{port}/cat.png")[0] == 200
    assert hits == ["/cat.png"]
    status, text = ask_about(opened, f"http://localhost:{port}/other.png")
    assert status == 400, text  # another name for the same host is another host
    assert hits == ["/cat.png"]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_deployments_engine_args_cannot_set_its_media_domains(kind):
    with pytest.raises(KindError, match="--allowed-media-domains"):
        get_kind(kind).check_args(["--allowed-media-domains", "169.254.169.254"])
    with pytest.raises(KindError, match="--allowed-media-domains"):
        get_kind(kind).check_args(["--allowed_media_domains=evil.example"])
