"""Golden command lines: exactly what CapyCTL runs for each kind (DESIGN §7). The launch
key is in none of them: it reaches each engine in its environment or a 0600 file."""

import json
from pathlib import Path
from typing import Any

import pytest

from hostagent.kinds import KindError, LaunchSpec, get_kind


def spec(command, **extra):
    values = {
        "command": command,
        "source": "/models/qwen",
        "served_name": "chat",
        "port": 41000,
        "api_key": "launch-key",
        "extra_args": ["--max-model-len", "8192"],
        "gpu_indices": [0, 1],
        "run_dir": Path("/data/run/i1"),
    }
    values.update(extra)
    return LaunchSpec(**values)


def test_vllm():
    launch = get_kind("vllm").build_launch(spec("/opt/vllm/bin/vllm"))
    assert launch.argv == [
        "/opt/vllm/bin/vllm", "serve", "/models/qwen", "--served-model-name", "chat",
        "--host", "127.0.0.1", "--port", "41000",
        "--enable-sleep-mode", "--max-model-len", "8192",
    ]  # fmt: skip
    assert launch.env == {
        "CUDA_VISIBLE_DEVICES": "0,1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": "launch-key",
        "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
    }  # fmt: skip
    assert launch.files == {}


def test_sglang_with_and_without_cpu_backup():
    launch = get_kind("sglang").build_launch(spec("python -m sglang.launch_server", extra_args=[]))
    assert launch.argv == [
        "python", "-m", "sglang.launch_server", "--model-path", "/models/qwen",
        "--served-model-name", "chat", "--host", "127.0.0.1", "--port", "41000",
        "--config", "/data/run/i1/sglang-config.yaml",
        "--enable-memory-saver", "--enable-weights-cpu-backup",
    ]  # fmt: skip
    (text,) = launch.files.values()
    assert launch.files.keys() == {Path("/data/run/i1/sglang-config.yaml")}
    assert json.loads(text) == {"api-key": "launch-key"}  # JSON is YAML, which SGLang reads
    deep_only = get_kind("sglang").build_launch(spec("sglang", extra_args=[], ram_park=False))
    assert "--enable-weights-cpu-backup" not in deep_only.argv
    assert deep_only.env == {"CUDA_VISIBLE_DEVICES": "0,1", "HF_HUB_OFFLINE": "1"}


def test_llamacpp():
    launch = get_kind("llamacpp").build_launch(
        spec(
            "/usr/bin/llama-server",
            source="/m/tiny.gguf",
            extra_args=["-c", "2048"],
            gpu_indices=[],
        )
    )
    assert launch.argv == [
        "/usr/bin/llama-server", "-m", "/m/tiny.gguf", "--alias", "chat",
        "--host", "127.0.0.1", "--port", "41000", "-c", "2048",
    ]  # fmt: skip
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "", "LLAMA_API_KEY": "launch-key"}


def test_tensorfold():
    launch = get_kind("tensorfold").build_launch(
        spec("tensorfold", extra_args=[], gpu_indices=None)
    )
    assert launch.argv == [
        "tensorfold", "serve", "/models/qwen", "--name", "chat",
        "--host", "127.0.0.1", "--port", "41000",
    ]  # fmt: skip
    assert launch.env == {
        "TENSORFOLD_API_KEY": "launch-key", "HF_HUB_OFFLINE": "1", "TENSORFOLD_NO_UPDATE_CHECK": "1"
    }  # fmt: skip


def test_custom_template_fills_each_argument_alone():
    template = (
        "my-server --listen {host}:{port} --key-file {api_key_file} --model {source} --name {model}"
    )
    launch = get_kind("custom").build_launch(
        spec(template, source="/models/a b; rm -rf /", extra_args=["--fast"], gpu_indices=[3])
    )
    assert launch.argv == [
        "my-server", "--listen", "127.0.0.1:41000", "--key-file", "/data/run/i1/api-key",
        "--model", "/models/a b; rm -rf /", "--name", "chat", "--fast",
    ]  # fmt: skip
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "3"}
    assert launch.files == {Path("/data/run/i1/api-key"): "launch-key\n"}


def test_custom_key_in_the_variable_its_options_name():
    launch = get_kind("custom").build_launch(
        spec("my-server --listen {host}:{port}", options={"api_key_env": "MY_KEY"}, extra_args=[])
    )
    assert launch.argv == ["my-server", "--listen", "127.0.0.1:41000"]
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "0,1", "MY_KEY": "launch-key"}
    assert launch.files == {}  # no {api_key_file}: no file


def test_key_variables_in_an_engines_env_are_dropped_the_kinds_own_set():
    env = {"VLLM_API_KEY": "other", "LLAMA_API_KEY": "other", "LLAMA_ARG_API_KEY_FILE": "/k",
           "TENSORFOLD_API_KEY": "other", "OMP_NUM_THREADS": "2"}  # fmt: skip
    for kind, own in (("vllm", "VLLM_API_KEY"), ("llamacpp", "LLAMA_API_KEY"),
                      ("tensorfold", "TENSORFOLD_API_KEY"), ("sglang", None)):  # fmt: skip
        launch = get_kind(kind).build_launch(spec(kind, env=env))
        keys = {name: value for name, value in launch.env.items() if "KEY" in name}
        assert keys == ({own: "launch-key"} if own else {}), kind
        assert launch.env["OMP_NUM_THREADS"] == "2"
        assert "launch-key" not in " ".join(launch.argv)


def test_the_claim_becomes_the_engines_memory_fraction():
    vllm = get_kind("vllm").build_launch(spec("vllm", extra_args=[], memory_fraction=2 / 3))
    assert vllm.argv[-2:] == ["--gpu-memory-utilization", "0.6666"]  # never above the claim
    sglang = get_kind("sglang").build_launch(spec("sglang", extra_args=[], memory_fraction=0.5))
    assert sglang.argv[-3:-1] == ["--mem-fraction-static", "0.5000"]
    own = get_kind("vllm").build_launch(
        spec("vllm", extra_args=["--gpu-memory-utilization=0.3"], memory_fraction=0.5)
    )
    assert own.argv.count("--gpu-memory-utilization") == 0
    assert own.argv[-1] == "--gpu-memory-utilization=0.3"


def test_engine_env_is_passed_on():
    launch = get_kind("llamacpp").build_launch(spec("llama-server", env={"OMP_NUM_THREADS": "2"}))
    assert launch.env["OMP_NUM_THREADS"] == "2"


def test_custom_options_are_checked():
    custom = get_kind("custom")
    good = {
        "health_path": "/ready",
        "park": {"ram": {"method": "POST", "path": "/offload"}},
        "wake": {"ram": {"path": "/reload", "json": {"all": True}}},
    }
    custom.check_options(good)
    assert custom.capabilities(good).ram
    assert not custom.capabilities(good).deep
    cases: list[tuple[dict[str, Any], str]] = [
        ({"colour": "blue"}, "unknown custom engine options"),
        ({"health_path": "ready"}, "health_path"),
        ({"park": {"ram": {"method": "POST"}}}, "park.ram"),
        ({"park": {"warm": {"path": "/x"}}}, "option park"),
        ({"wake": {"deep": {"path": "/x", "method": "DELETE"}}}, "wake.deep.method"),
    ]
    for bad, message in cases:
        with pytest.raises(KindError, match=message):
            custom.check_options(bad)
    with pytest.raises(KindError, match="options are for the 'custom' kind"):
        get_kind("vllm").check_options({"health_path": "/x"})
