"""A simulated engine's state (its options, knobs, memory, stored Responses, readiness)
and the plumbing every route uses: JSON answers and refusals, the API key, a request's
body checked as the engine checks it, and the request recorder."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from aiohttp import web

from hostagent.sim.load import PrefixCache, Scheduler
from hostagent.sim.memory import SimMemory
from hostagent.sim.options import Knobs, SimOptions
from hostagent.sim.validation import missing_field

JSON = "application/json"


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(data).encode(), status=status, content_type=JSON)


async def _held_at(gate: Path | None) -> None:
    """Wait until the gate file exists; ``GATE.waiting`` tells a test something is held
    (tests wait on that file, not on a clock)."""
    if gate is None or gate.exists():
        return
    gate.with_name(f"{gate.name}.waiting").touch()
    while not gate.exists():
        await asyncio.sleep(0.05)


def _error(message: str, status: int, kind: str = "invalid_request_error") -> web.Response:
    return _json(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status
    )


def _form_value(value: str | bytes | bytearray | web.FileField) -> str | bytes:
    if isinstance(value, web.FileField):
        return value.file.read()
    return value if isinstance(value, str) else bytes(value)


class EngineState:
    """What a simulated engine holds, and what its routes share."""

    def __init__(self, options: SimOptions, knobs: Knobs) -> None:
        self.options = options
        self.knobs = knobs
        self.memory = SimMemory(options, knobs)
        self.scheduler = Scheduler(knobs.max_concurrency)
        self.prefix_cache = PrefixCache(knobs.prefix_cache_tokens)
        self.requests = 0
        self.responses: dict[str, dict[str, Any]] = {}
        self.created = int(time.time())
        self.ready = asyncio.Event()
        # After a deep park with CAPYCTL_SIM_DEEP_WAKE_SECONDS: the wake's time is the reload's.
        self.reload_pending = False
        # LoRA adapters loaded at run time, name: path, least recently used first
        # (hostagent/sim/adapters.py); llama-server's --lora files' scales.
        self.adapters: OrderedDict[str, str] = OrderedDict()
        self.llama_scales: list[float] = []
        record = os.environ.get("CAPYCTL_SIM_RECORD", "")
        self._record = Path(record).open("a", buffering=1) if record else None  # noqa: SIM115

    @web.middleware
    async def _recorder(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """With ``CAPYCTL_SIM_RECORD``: each request's method, path as received, path as
        routed and header names, and what a JSON body names its model and adapter by
        (``model``, ``lora``, ``lora_path``), one JSON line each, so tests see what reached
        the engine (header values are left out: they carry the launch key)."""
        if self._record is not None:
            seen = {
                "method": request.method,
                "raw_path": request.raw_path,
                "path": request.path,
                "headers": sorted({name.lower() for name in request.headers}),
            }
            if request.method == "POST" and request.content_type == "application/json":
                try:  # what names the model and its adapter (the body is read once, kept)
                    body = json.loads(await request.read())
                except ValueError:
                    body = None
                if isinstance(body, dict):
                    seen.update({k: body[k] for k in ("model", "lora", "lora_path") if k in body})
            self._record.write(json.dumps(seen) + "\n")
        response: web.StreamResponse = await handler(request)
        return response

    # -- plumbing ---------------------------------------------------------------------------

    def authorized(self, request: web.Request) -> bool:
        if not self.options.api_keys:
            return True
        header = request.headers.get("Authorization", "")
        given = header.removeprefix("Bearer ").strip() or request.headers.get("X-Api-Key", "")
        return given in self.options.api_keys

    def count_request(self) -> None:
        self.requests += 1
        crash = self.knobs.crash_after
        if crash is not None and self.requests > crash:
            os._exit(3)  # the fault switch: die like a crashed engine, mid-request

    async def _body(  # noqa: PLR0911 - each refusal is its own early answer
        self, request: web.Request, required: str | None = None
    ) -> dict[str, Any] | web.Response:
        """The request's JSON body, or the engine's refusal; ``required`` names a field the
        route cannot do without (checked before the model, as the engines validate first)."""
        if not self.authorized(request):
            return _error("Invalid API key", 401, "authentication_error")
        if not self.ready.is_set():
            return _error("Loading model", 503, "unavailable_error")
        body: Any
        try:
            if request.content_type == "multipart/form-data":
                form = await request.post()
                body = {k: _form_value(v) for k, v in form.items()}
            else:
                body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            return _error("request body is not valid JSON", 400)
        if not isinstance(body, dict):
            return _error("request body must be a JSON object", 400)
        missing = missing_field(self.options.kind, required, body) if required else None
        if missing is not None:
            return _json(missing[1], missing[0])
        # TensorFold serves any `model` under its --name (src/tensorfold/cuda/http.py).
        known = body.get("model") in (self.options.served_name, None)
        known = known or self.serves_model(body.get("model"))
        if not known and self.options.kind != "tensorfold":
            return _error(f"The model `{body.get('model')}` does not exist.", 404, "NotFoundError")
        if not self.memory.serving and self.memory.devices:
            return _error("the engine is sleeping or its weights are not loaded", 503)
        refused = self.adapter_refusal(body)
        if refused is not None:
            return refused
        self.count_request()
        return body

    # Adapters (overridden by hostagent.sim.adapters.AdapterRoutes).

    def serves_model(self, model: object) -> bool:
        return False

    def adapter_refusal(self, body: dict[str, Any]) -> web.Response | None:
        return None

    def answer_model(self, body: dict[str, Any]) -> str:
        return self.options.served_name

    def _tokens(self, body: dict[str, Any]) -> int:
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        wanted = self.knobs.completion_tokens
        return max(1, min(int(limit), wanted)) if limit else wanted
