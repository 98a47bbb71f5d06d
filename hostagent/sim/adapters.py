"""The simulated engines' LoRA adapters, each as its engine serves them.

- vLLM (``vllm/entrypoints/serve/lora/api_router.py``, ``openai/models/serving.py``):
  ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}`` and ``POST
  /v1/unload_lora_adapter`` ``{lora_name}`` exist only with
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` true; success is 200 with a plain-text line; a name
  already loaded is 400 ``InvalidUserInput``, a path with no adapter 404 ``NotFoundError``
  ("Loading lora X failed: No adapter found for P"), an unknown name on unload 404
  ("The lora adapter 'X' cannot be found."); other failures of the load (a rank above
  ``--max-lora-rank``) 500. Loaded adapters are listed in ``/v1/models`` with ``root`` (the
  path) and ``parent`` (the base), served under their own name as ``model``; a name not
  loaded is 404 "The model `X` does not exist.". Any number may be loaded: ``--max-loras``
  are on the GPU at once, the rest wait in its CPU cache or on disk.
- SGLang (``http_server.py``, ``tokenizer_control_mixin.py``, ``lora/lora_registry.py``):
  ``POST /load_lora_adapter`` and ``/unload_lora_adapter`` always exist and answer
  ``{success, error_message, loaded_adapters}``, 200 or 400; without ``--enable-lora`` both
  say so. A request names its adapter in ``lora_path`` (or ``model: "BASE:ADAPTER"``); one
  not loaded is refused (400) naming the loaded ones.
- llama-server (``tools/server``): ``--lora FILE`` (repeatable) loads adapters at start (a
  missing file ends the start), ``--lora-init-without-apply`` leaves them at scale 0;
  ``GET /lora-adapters`` lists ``{id, path, scale}``, ``POST /lora-adapters`` sets the
  scales; a request's ``lora: [{"id", "scale"}]`` applies them for that request alone, an
  id out of range is 400 "invalid adapter id".

Loading takes ``CAPYCTL_SIM_LORA_LOAD_SECONDS`` (default 0.05). An adapter's rank is read
from its folder's ``adapter_config.json`` (``r``) where there is one.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from aiohttp import web

from hostagent.sim.engine_state import EngineState, _error, _json

# vllm/envs.py: VLLM_ALLOW_RUNTIME_LORA_UPDATING is "1" or "true" (any case).
RUNTIME_VARIABLE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating() -> bool:
    return os.environ.get(RUNTIME_VARIABLE, "0").strip().lower() in ("1", "true")


def _rank(path: str) -> int | None:
    config = Path(path) / "adapter_config.json"
    try:
        return int(json.loads(config.read_text(encoding="utf-8"))["r"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _sglang_error(message: str, status: int = 400) -> web.Response:
    """SGLang's OpenAI error (``entrypoints/openai/protocol.py``, ``ErrorResponse``)."""
    body = {
        "object": "error",
        "message": message,
        "type": "BadRequestError",
        "param": None,
        "code": status,
    }
    return _json(body, status)


class AdapterRoutes(EngineState):
    """Adapter state (name: path, in least-recently-used order) and routes."""

    def adapter_routes(self, app: web.Application) -> None:
        kind = self.options.kind
        if kind == "vllm" and runtime_updating():
            app.router.add_post("/v1/load_lora_adapter", self.vllm_load)
            app.router.add_post("/v1/unload_lora_adapter", self.vllm_unload)
        if kind == "sglang":
            app.router.add_post("/load_lora_adapter", self.sglang_load)
            app.router.add_post("/unload_lora_adapter", self.sglang_unload)
        if kind == "llamacpp":
            app.router.add_get("/lora-adapters", self.llama_list)
            app.router.add_post("/lora-adapters", self.llama_apply)
            self.llama_scales = [
                0.0 if self.options.lora_init_without_apply else 1.0
                for _ in self.options.lora_files
            ]

    def adapter_cards(self) -> list[dict[str, Any]]:
        return [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": self.options.kind,
                "root": path,
                "parent": self.options.served_name,
            }
            for name, path in self.adapters.items()
        ]

    async def _control_body(self, request: web.Request) -> dict[str, Any] | web.Response:
        if not self.authorized(request):
            return _error("Invalid API key", 401, "authentication_error")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            return _error("request body is not valid JSON", 400)
        return body if isinstance(body, dict) else _error("request body must be an object", 400)

    # -- vLLM -------------------------------------------------------------------------------

    async def vllm_load(self, request: web.Request) -> web.Response:  # noqa: PLR0911 - one answer a refusal
        body = await self._control_body(request)
        if isinstance(body, web.Response):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return _error(
                "Both 'lora_name' and 'lora_path' must be provided.", 400, "InvalidUserInput"
            )
        if name in self.adapters and not body.get("load_inplace"):
            return _error(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                400,
                "InvalidUserInput",
            )
        if not self.options.lora:
            return _error(
                "LoRA is not enabled. Use --enable-lora to enable LoRA.", 500, "InternalServerError"
            )
        if not Path(path).exists():
            return _error(
                f"Loading lora {name} failed: No adapter found for {path}", 404, "NotFoundError"
            )
        rank = _rank(path)
        if rank is not None and rank > self.options.lora_max_rank:
            return _error(
                f"LoRA rank {rank} is greater than max_lora_rank {self.options.lora_max_rank}.",
                500,
                "InternalServerError",
            )
        await asyncio.sleep(self.knobs.lora_load_seconds)
        self.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def vllm_unload(self, request: web.Request) -> web.Response:
        body = await self._control_body(request)
        if isinstance(body, web.Response):
            return body
        name = body.get("lora_name")
        if not name:
            return _error(
                "'lora_name' needs to be provided to unload a LoRA adapter.",
                400,
                "InvalidUserInput",
            )
        if name not in self.adapters:
            return _error(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
        del self.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # -- SGLang -----------------------------------------------------------------------------

    def _sglang_answer(self, error: str = "") -> web.Response:
        loaded = dict(self.adapters) if not error else None
        body = {"success": not error, "error_message": error, "loaded_adapters": loaded}
        return _json(body, 400 if error else 200)

    def _loaded_keys(self) -> str:
        return f"odict_keys({list(self.adapters)!r})"

    async def sglang_load(self, request: web.Request) -> web.Response:
        body = await self._control_body(request)
        if isinstance(body, web.Response):
            return body
        if not self.options.lora:
            return self._sglang_answer(
                "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
            )
        name, path = str(body.get("lora_name")), str(body.get("lora_path"))
        if name in self.adapters:
            return self._sglang_answer(
                f"LoRA with name {name} already exists. Loaded LoRAs: {self._loaded_keys()}"
            )
        if not Path(path).exists():
            # LoRAConfig(path) takes a path that is not there for a Hub id to download.
            return self._sglang_answer(
                f"Failed to load LoRA adapter {name}: Can't find 'adapter_config.json' at '{path}'"
            )
        rank = _rank(path)
        if rank is not None and rank > self.options.lora_max_rank:
            return self._sglang_answer(
                f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA "
                "memory pool configuration. Please ensure that the LoRA adapter's rank is "
                "within the configured `--max-lora-rank` and that the target modules are "
                "included in `--lora-target-modules`."
            )
        await asyncio.sleep(self.knobs.lora_load_seconds)
        self.adapters[name] = path
        return self._sglang_answer()

    async def sglang_unload(self, request: web.Request) -> web.Response:
        body = await self._control_body(request)
        if isinstance(body, web.Response):
            return body
        if not self.options.lora:
            return self._sglang_answer(
                "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
            )
        name = str(body.get("lora_name"))
        if name not in self.adapters:
            return self._sglang_answer(
                f"LoRA with name {name} does not exist. Loaded LoRAs: {self._loaded_keys()}"
            )
        del self.adapters[name]
        return self._sglang_answer()

    # -- llama-server -----------------------------------------------------------------------

    async def llama_list(self, request: web.Request) -> web.Response:
        return _json(
            [
                {"id": i, "path": path, "scale": self.llama_scales[i]}
                for i, path in enumerate(self.options.lora_files)
            ]
        )

    async def llama_apply(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return _error("Invalid API key", 401, "authentication_error")
        body = await request.json()
        scales = [0.0 for _ in self.options.lora_files]
        for entry in body if isinstance(body, list) else []:
            index = int(entry.get("id", -1))
            if not 0 <= index < len(scales):
                return _json(
                    {
                        "error": {
                            "code": 500,
                            "message": "invalid adapter id",
                            "type": "server_error",
                        }
                    },
                    500,
                )
            scales[index] = float(entry.get("scale", 0.0))
        self.llama_scales = scales
        return _json({"success": True})

    # -- requests that name an adapter --------------------------------------------------------

    def adapter_refusal(self, body: dict[str, Any]) -> web.Response | None:
        """The engine's refusal of a request naming an adapter it has not loaded (None:
        the request may go on; an unknown plain model is refused elsewhere)."""
        kind = self.options.kind
        if kind == "sglang":
            name = self._sglang_adapter(body)
            if name is not None and name not in self.adapters:
                return _sglang_error(
                    f"The following requested LoRA adapters are not loaded: {name}\n"
                    f"Loaded adapters: {self._loaded_keys()}."
                )
            if name is not None:
                self.adapters.move_to_end(name)
        if kind == "llamacpp" and "lora" in body:
            entries = body.get("lora")
            for entry in entries if isinstance(entries, list) else []:
                index = entry.get("id", -1) if isinstance(entry, dict) else -1
                if not isinstance(index, int) or not 0 <= index < len(self.options.lora_files):
                    return _json(
                        {
                            "error": {
                                "code": 400,
                                "message": "invalid adapter id",
                                "type": "invalid_request_error",
                            }
                        },
                        400,
                    )
        return None

    def _sglang_adapter(self, body: dict[str, Any]) -> str | None:
        model = body.get("model")
        if isinstance(model, str) and ":" in model:
            return model.split(":", 1)[1]
        path = body.get("lora_path")
        return str(path) if path else None

    def serves_model(self, model: object) -> bool:
        """Whether ``model`` is a name the engine answers to beside its served name: a
        loaded vLLM adapter, or SGLang's ``BASE:ADAPTER``."""
        if self.options.kind == "vllm":
            return model in self.adapters
        if self.options.kind == "sglang" and isinstance(model, str) and ":" in model:
            return model.split(":", 1)[0] == self.options.served_name
        return False

    def answer_model(self, body: dict[str, Any]) -> str:
        """The ``model`` an answer carries: vLLM's adapter name, SGLang the request's own."""
        model = body.get("model")
        if isinstance(model, str) and self.serves_model(model):
            return model
        return self.options.served_name
