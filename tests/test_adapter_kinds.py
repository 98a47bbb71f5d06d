"""LoRA adapters, kind by kind: the flags a launch with adapter slots adds, what each kind
refuses, what a request must carry, and the kinds' calls against the simulated engines'
real answers (in process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hostagent.errors import AdapterError
from hostagent.kinds import KindError, LaunchSpec, get_kind
from hostagent.kinds.adapters import adapter_request_fields, check_adapter_name
from hostagent.versions import EngineFeatures


def spec(tmp_path: Path, **changes: Any) -> LaunchSpec:
    fields: dict[str, Any] = {
        "command": "engine",
        "source": "/models/base",
        "served_name": "base",
        "port": 8000,
        "api_key": "k",
        "run_dir": tmp_path,
    }
    return LaunchSpec(**{**fields, **changes})


def tail(argv: list[str], flag: str) -> list[str]:
    return argv[argv.index(flag) :]


def test_vllm_with_slots_enables_lora_and_its_runtime_routes(tmp_path: Path) -> None:
    launch = get_kind("vllm").build_launch(spec(tmp_path, adapter_slots=4, adapter_max_rank=64))
    assert tail(launch.argv, "--enable-lora") == [
        "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "4", "--max-lora-rank", "64",
    ]  # fmt: skip
    assert launch.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    plain = get_kind("vllm").build_launch(spec(tmp_path))
    assert "--enable-lora" not in plain.argv
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.env
    default_rank = get_kind("vllm").build_launch(spec(tmp_path, adapter_slots=1))
    assert "--max-lora-rank" not in default_rank.argv  # vLLM's own default, 16


def test_vllm_refuses_a_rank_it_does_not_take(tmp_path: Path) -> None:
    with pytest.raises(KindError, match=r"1, 8, 16, .* 512 \(got 48\)"):
        get_kind("vllm").build_launch(spec(tmp_path, adapter_slots=1, adapter_max_rank=48))


def test_sglang_with_slots_counts_the_base_in_its_pool(tmp_path: Path) -> None:
    launch = get_kind("sglang").build_launch(spec(tmp_path, adapter_slots=2))
    assert tail(launch.argv, "--enable-lora") == [
        "--enable-lora", "--max-loras-per-batch", "3", "--max-lora-rank", "16",
        "--lora-target-modules", "all",
    ]  # fmt: skip
    ranked = get_kind("sglang").build_launch(spec(tmp_path, adapter_slots=2, adapter_max_rank=8))
    assert ranked.argv[ranked.argv.index("--max-lora-rank") + 1] == "8"


def test_llama_server_loads_its_adapters_at_launch_unapplied(tmp_path: Path) -> None:
    adapters = [("sql", "/a/sql.gguf"), ("poet", "/a/poet.gguf")]
    launch = get_kind("llamacpp").build_launch(spec(tmp_path, adapter_slots=2, adapters=adapters))
    assert tail(launch.argv, "--lora") == [
        "--lora", "/a/sql.gguf", "--lora", "/a/poet.gguf", "--lora-init-without-apply",
    ]  # fmt: skip
    with pytest.raises(KindError, match="3 adapters given to a llamacpp launch with 2"):
        get_kind("llamacpp").build_launch(
            spec(tmp_path, adapter_slots=2, adapters=[*adapters, ("x", "/a/x.gguf")])
        )


@pytest.mark.parametrize(
    ("kind", "arg", "flag"),
    [
        ("vllm", "--max-loras=8", "--max-loras"),
        ("vllm", "--max_lora_rank", "--max-lora-rank"),
        ("sglang", "--lora-paths", "--lora-paths"),
        ("sglang", "--max-loaded-loras", "--max-loaded-loras"),
        ("llamacpp", "--lora-scaled", "--lora-scaled"),
    ],
)
def test_args_may_not_set_what_the_slots_set(
    tmp_path: Path, kind: str, arg: str, flag: str
) -> None:
    with pytest.raises(KindError, match=f"may not set {flag}: .* adapter slots"):
        get_kind(kind).build_launch(spec(tmp_path, adapter_slots=1, extra_args=[arg, "2"]))
    # Without slots the deployment's own LoRA flags are its business.
    get_kind(kind).build_launch(spec(tmp_path, extra_args=[arg, "2"]))


@pytest.mark.parametrize("kind", ["tensorfold", "custom"])
def test_kinds_without_adapters_refuse_slots_in_one_line(tmp_path: Path, kind: str) -> None:
    command = "srv --port {port} --host {host}" if kind == "custom" else "tensorfold"
    with pytest.raises(KindError, match=f"^{kind} cannot serve LoRA adapters"):
        get_kind(kind).build_launch(spec(tmp_path, command=command, adapter_slots=1))


def test_adapters_need_slots_and_runtime_kinds_take_none_at_launch(tmp_path: Path) -> None:
    with pytest.raises(KindError, match="1 adapters given to a llamacpp launch with no slots"):
        get_kind("llamacpp").build_launch(spec(tmp_path, adapters=[("a", "/a.gguf")]))
    for kind in ("vllm", "sglang"):
        with pytest.raises(KindError, match=f"{kind} loads adapters while running"):
            get_kind(kind).build_launch(spec(tmp_path, adapter_slots=1, adapters=[("a", "/a")]))


def test_capabilities_follow_each_programs_help() -> None:
    bare = EngineFeatures(version="1", flags=frozenset({"--port"}))
    lora = EngineFeatures(version="1", flags=frozenset({"--enable-lora"}))
    assert not get_kind("vllm").capabilities({}, bare).adapters
    assert get_kind("vllm").capabilities({}, lora).runtime_adapters
    assert not get_kind("sglang").capabilities({}, bare).runtime_adapters
    llama = EngineFeatures(version="1", flags=frozenset({"--lora-init-without-apply"}))
    caps = get_kind("llamacpp").capabilities({}, llama)
    assert (caps.adapters, caps.runtime_adapters) == (True, False)
    assert not get_kind("llamacpp").capabilities({}, bare).adapters


def test_request_fields_per_kind() -> None:
    assert adapter_request_fields("vllm", "base", "sql", 0) == {"model": "sql"}
    assert adapter_request_fields("sglang", "base", "sql", 0) == {
        "model": "base",
        "lora_path": "sql",
    }
    assert adapter_request_fields("llamacpp", "base", "sql", 2) == {
        "model": "base",
        "lora": [{"id": 2, "scale": 1.0}],
    }
    with pytest.raises(AdapterError, match="tensorfold cannot serve"):
        adapter_request_fields("tensorfold", "base", "sql", 0)


@pytest.mark.parametrize("name", ["", "a b", "../x", "-x", "x" * 129, None, "a/b"])
def test_adapter_names_are_checked(name: object) -> None:
    with pytest.raises(AdapterError, match="invalid adapter name"):
        check_adapter_name(name)
    assert check_adapter_name("sql-v2.1_b") == "sql-v2.1_b"


def test_llama_server_cannot_load_while_running(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="llamacpp cannot load adapters while running"):
        get_kind("llamacpp").load_adapter(None, spec(tmp_path), "a", "/a")  # type: ignore[arg-type]
