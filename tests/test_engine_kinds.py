"""The engine-kind registry and what each kind accepts."""

from typing import Any

import pytest

from hostagent.kinds import (
    REGISTRY,
    Capabilities,
    KindError,
    UnknownKindError,
    get_kind,
    kind_names,
)


def test_every_design_kind_is_registered():
    assert kind_names() == ["vllm", "sglang", "llamacpp", "tensorfold", "custom"]
    for name, kind in REGISTRY.items():
        assert kind.name == name
        assert kind.description


def test_park_capabilities_follow_the_engines():
    both = Capabilities(ram=True, deep=True, adapters=True, runtime_adapters=True)
    assert get_kind("vllm").capabilities({}) == both
    assert get_kind("sglang").capabilities({}) == both
    assert get_kind("llamacpp").capabilities({}) == Capabilities(adapters=True)
    for name in ("tensorfold", "custom"):
        assert get_kind(name).capabilities({}) == Capabilities()


def test_unknown_kind_names_the_known_ones():
    with pytest.raises(UnknownKindError, match=r"'ollama'.*vllm, sglang"):
        get_kind("ollama")


def test_program_commands_are_split_without_a_shell():
    assert get_kind("vllm").check_command("/opt/vllm/bin/vllm") == ["/opt/vllm/bin/vllm"]
    assert get_kind("llamacpp").check_command("'/opt/my llama/llama-server' -t 4") == [
        "/opt/my llama/llama-server",
        "-t",
        "4",
    ]
    with pytest.raises(KindError, match="empty"):
        get_kind("vllm").check_command("   ")
    with pytest.raises(KindError, match="No closing quotation"):
        get_kind("vllm").check_command("'/opt/vllm")
    with pytest.raises(KindError, match="custom"):
        get_kind("vllm").check_command("vllm --port {port}")


def test_custom_templates_need_a_port_and_known_placeholders():
    custom = get_kind("custom")
    argv = custom.check_command("myserver --listen {host}:{port} --keys {api_key_file} {source}")
    assert argv == ["myserver", "--listen", "{host}:{port}", "--keys", "{api_key_file}", "{source}"]
    with pytest.raises(KindError, match=r"must contain \{port\}"):
        custom.check_command("myserver --model {model}")
    with pytest.raises(KindError, match=r"unknown placeholder \{gpu\}"):
        custom.check_command("myserver --port {port} --gpu {gpu}")


def test_a_custom_template_may_not_put_the_key_on_the_command_line():
    with pytest.raises(KindError) as info:
        get_kind("custom").check_command("myserver --listen {host}:{port} --key {api_key}")
    message = str(info.value)
    assert "\n" not in message
    assert "{api_key} would put the launch key on the command line" in message
    assert "use {api_key_file}" in message
    assert "api_key_env" in message


def test_custom_api_key_env_must_name_a_variable():
    get_kind("custom").check_options({"api_key_env": "MY_SERVER_KEY"})
    for bad in ("", "MY-KEY", "1KEY", "A=B", 3):
        with pytest.raises(KindError, match="api_key_env must be an environment variable name"):
            get_kind("custom").check_options({"api_key_env": bad})


@pytest.mark.parametrize("flag", ["--host", "--port=9000", "--api-key", "--served-model-name"])
def test_engine_args_cannot_override_what_capyctl_sets(flag):
    with pytest.raises(KindError, match="may not set"):
        get_kind("vllm").check_args(["--max-model-len", "4096", flag, "x"])


def test_harmless_engine_args_pass():
    get_kind("vllm").check_args(["--gpu-memory-utilization", "0.5", "--max-model-len", "8192"])
    get_kind("llamacpp").check_args(["-c", "2048", "-t", "1"])


def test_engine_control_calls_reach_the_same_urls_as_httpx_would_build():
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx

    from hostagent.kinds.client import EngineClient

    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        client = EngineClient(port, "key")
        plain = httpx.Client(base_url=f"http://127.0.0.1:{port}")
        calls: list[tuple[str, dict[str, Any] | None]] = [
            ("/sleep", {"level": 1}),
            ("/sleep", {"level": 2}),
            ("/wake_up", {"tags": "weights"}),
            ("/reset_prefix_cache", None),
            ("/wake_up", {"tags": "a&b=c"}),  # not plain: left to httpx
            ("//elsewhere/x", None),  # not plain: left to httpx
            ("/a b", None),
            ("/sleep", {"level": True}),  # after level=1: httpx writes true
            ("/wake_up", {"tags": ["weights", "kv_cache"]}),
        ]
        for path, params in calls * 2:  # the second time from its kept URLs
            client.request("POST", path, params=params)
            plain.post(path, params=params)
        assert seen[0::2] == seen[1::2]  # each call as httpx itself sends it
        assert (
            seen[:6]
            == ["/sleep?level=1"] * 2 + ["/sleep?level=2"] * 2 + ["/wake_up?tags=weights"] * 2
        )
        client.close()
        plain.close()
    finally:
        server.shutdown()
