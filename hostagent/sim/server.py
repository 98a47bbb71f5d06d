"""The simulated engine's HTTP server (aiohttp: fast enough to be a benchmark upstream):
each engine's route table, the app that serves it, the model's load, and ``main``.

The routes live in :mod:`hostagent.sim.inference` (generated answers) and
:mod:`hostagent.sim.control` (health, information, park and wake), on the state and
plumbing of :mod:`hostagent.sim.engine_state`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from aiohttp import web

from hostagent.sim.adapters import AdapterRoutes
from hostagent.sim.control import ControlRoutes
from hostagent.sim.engine_state import _held_at
from hostagent.sim.inference import InferenceRoutes
from hostagent.sim.options import parse_options, read_knobs
from hostagent.sim.tfsleep import TensorFoldSleep, sleep_token

# Each engine's routes as its source registers them (with the default flags; the sleep
# routes follow below): vLLM vllm/entrypoints/ (openai/, anthropic/, serve/, generate/),
# SGLang python/sglang/srt/entrypoints/http_server.py, llama-server tools/server/server.cpp,
# TensorFold src/tensorfold/cuda/http.py. docs/engines.md has the table, and
# tests/test_sim_fidelity.py holds it to these.
_OPENAI = [
    ("GET", "/v1/models", "models"),
    ("POST", "/v1/chat/completions", "chat"),
    ("POST", "/v1/completions", "completions"),
    ("POST", "/v1/responses", "create_response"),
    ("POST", "/v1/messages", "messages"),
]
ROUTES: dict[str, list[tuple[str, str, str]]] = {
    "vllm": [
        *_OPENAI,
        ("GET", "/health", "health"),
        ("GET", "/ping", "ping"),
        ("GET", "/version", "version"),
        ("GET", "/metrics", "metrics"),
        ("POST", "/v1/embeddings", "embeddings"),
        ("GET", "/v1/responses/{ident}", "get_response"),
        ("POST", "/v1/responses/{ident}/cancel", "cancel_response"),
        ("POST", "/v1/audio/transcriptions", "transcription"),
        # Served by no real kind: kept so the gateway's binary pass-through is tested.
        ("POST", "/v1/audio/speech", "speech"),
        ("POST", "/tokenize", "tokenize"),
        ("POST", "/detokenize", "detokenize"),
    ],
    "sglang": [
        *_OPENAI,
        ("GET", "/health", "health"),
        ("GET", "/health_generate", "health"),
        ("GET", "/get_model_info", "model_info"),
        ("POST", "/v1/embeddings", "embeddings"),
        ("GET", "/v1/responses/{ident}", "get_response"),
        ("POST", "/v1/responses/{ident}/cancel", "cancel_response"),
        ("POST", "/v1/audio/transcriptions", "transcription"),
        ("POST", "/tokenize", "tokenize"),
        ("POST", "/v1/tokenize", "tokenize"),
    ],
    "llamacpp": [
        *_OPENAI,
        ("GET", "/health", "health"),
        ("GET", "/v1/health", "health"),
        ("GET", "/models", "models"),
        ("POST", "/v1/embeddings", "embeddings"),
        ("POST", "/v1/audio/transcriptions", "transcription"),
        ("POST", "/tokenize", "tokenize"),
        ("POST", "/detokenize", "detokenize"),
    ],
    "tensorfold": [
        *_OPENAI,
        ("GET", "/health", "health"),
        ("GET", "/v1/health", "health"),
        ("GET", "/models", "models"),
        ("GET", "/metrics", "metrics"),
        ("GET", "/v1/metrics", "metrics"),
        ("GET", "/v1/responses/{ident}", "get_response"),
        ("DELETE", "/v1/responses/{ident}", "delete_response"),
        ("POST", "/tokenize", "tokenize"),
        ("POST", "/v1/tokenize", "tokenize"),
    ],
}
# vLLM's development routes (VLLM_SERVER_DEV_MODE=1: vllm/entrypoints/serve/dev/).
VLLM_DEV_ROUTES = [
    ("POST", "/sleep", "sleep"),
    ("POST", "/wake_up", "wake_up"),
    ("GET", "/is_sleeping", "is_sleeping"),
    ("POST", "/collective_rpc", "collective_rpc"),
    ("POST", "/reset_prefix_cache", "reset_prefix_cache"),
]


class SimEngine(AdapterRoutes, InferenceRoutes, ControlRoutes):
    """A simulated engine: its routes (those of its kind), served by an aiohttp app once
    its model is loaded."""

    def app(self) -> web.Application:
        middlewares = [self._recorder] if self._record is not None else []
        app = web.Application(client_max_size=64 * 1024**2, middlewares=middlewares)
        for method, path, name in ROUTES[self.options.kind]:
            app.router.add_route(method, path, getattr(self, name))
        dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
        if self.options.kind == "vllm" and dev_mode:
            # vllm/entrypoints/serve/dev/: these exist only in dev mode, sleep mode or not.
            for method, path, name in VLLM_DEV_ROUTES:
                app.router.add_route(method, path, getattr(self, name))
        if self.options.kind == "sglang":
            # Always there (entrypoints/http_server.py); without --enable-memory-saver its
            # memory saver is a no-op: a release answers 200 and frees nothing.
            app.router.add_post("/release_memory_occupation", self.release)
            app.router.add_post("/resume_memory_occupation", self.resume)
            app.router.add_post("/update_weights_from_disk", self.update_weights)
        self.adapter_routes(app)  # LoRA adapters, as each engine serves them
        # -- TensorFold's prototype sleep API (hostagent/sim/tfsleep.py) --
        if self.options.kind == "tensorfold" and self.options.sleep_mode:
            TensorFoldSleep(self, sleep_token()).add_routes(app)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, app: web.Application) -> None:
        self.memory.clear()

    async def _load(self) -> None:
        missing = [path for path in self.options.lora_files if not Path(path).exists()]
        if missing:  # llama-server: common_init_from_params fails, the server exits
            print(f"failed to apply lora adapter '{missing[0]}'", flush=True)
            os._exit(1)
        await _held_at(self.knobs.load_gate)
        await asyncio.sleep(self.knobs.load_seconds)
        self.memory.load()
        self.ready.set()

    async def serve(self) -> None:
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=True)
        await runner.setup()
        if self.options.kind != "llamacpp":
            # vLLM, SGLang and TensorFold open their port only once the model is loaded.
            await self._load()
        path = self.options.socket_path
        site: web.BaseSite
        if path is not None:  # a Unix socket, and no TCP port at all
            site = web.UnixSite(runner, path, backlog=2048)
        else:
            site = web.TCPSite(runner, self.options.host, self.options.port, backlog=2048)
        try:
            await site.start()
        except OSError as exc:  # llama-server: "couldn't bind HTTP server socket", exit 1
            print(f"couldn't bind HTTP server socket, hostname: {self.options.host}: {exc}")
            raise SystemExit(1) from None
        where = path or f"{self.options.host}:{self.options.port}"
        print(
            f"simulated {self.options.kind} serving {self.options.served_name!r} on {where}",
            flush=True,
        )
        if self.options.kind == "llamacpp":
            await self._load()  # llama-server answers 503 on /health while loading
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()


def main(argv: list[str]) -> int:
    options = parse_options(argv)
    knobs = read_knobs()
    if knobs.device == "cuda":  # its copies' lines (bytes, seconds, GB/s) go to its log
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    engine = SimEngine(options, knobs)
    try:
        import uvloop  # noqa: PLC0415 - optional: without it the simulator runs on asyncio's loop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency, but not required
        pass
    try:
        asyncio.run(engine.serve())
    except (KeyboardInterrupt, web.GracefulExit):
        pass
    finally:
        engine.memory.clear()
    return 0
