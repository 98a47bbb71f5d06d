"""The simulated engine's HTTP server (aiohttp: fast enough to be a benchmark upstream)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from hostagent.sim.media import load_media
from hostagent.sim.memory import SimMemory
from hostagent.sim.options import Knobs, SimOptions, parse_options, read_knobs
from hostagent.sim.responses import ResponseStream, final_status
from hostagent.sim.tfsleep import TensorFoldSleep, sleep_token
from hostagent.sim.validation import missing_field

JSON = "application/json"
_HEALTH_OK = {
    "vllm": b"",
    "sglang": b"",
    "llamacpp": b'{"status":"ok"}',
    "tensorfold": b'{"status":"ok"}',
}


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


class SimEngine:
    def __init__(self, options: SimOptions, knobs: Knobs) -> None:
        self.options = options
        self.knobs = knobs
        self.memory = SimMemory(options, knobs)
        self.requests = 0
        self.responses: dict[str, dict[str, Any]] = {}
        self.created = int(time.time())
        self.ready = asyncio.Event()
        # After a deep park with CAPYCTL_SIM_DEEP_WAKE_SECONDS: the wake's time is the reload's.
        self.reload_pending = False
        record = os.environ.get("CAPYCTL_SIM_RECORD", "")
        self._record = Path(record).open("a", buffering=1) if record else None  # noqa: SIM115

    @web.middleware
    async def _recorder(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """With ``CAPYCTL_SIM_RECORD``: each request's method, path as received, path as
        routed and header names, one JSON line each, so tests see what reached the engine
        (header values are left out: they carry the launch key)."""
        if self._record is not None:
            seen = {
                "method": request.method,
                "raw_path": request.raw_path,
                "path": request.path,
                "headers": sorted({name.lower() for name in request.headers}),
            }
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
        if not known and self.options.kind != "tensorfold":
            return _error(f"The model `{body.get('model')}` does not exist.", 404, "NotFoundError")
        if not self.memory.serving and self.memory.devices:
            return _error("the engine is sleeping or its weights are not loaded", 503)
        self.count_request()
        return body

    def _tokens(self, body: dict[str, Any]) -> int:
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        wanted = self.knobs.completion_tokens
        return max(1, min(int(limit), wanted)) if limit else wanted

    # -- OpenAI routes ----------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        if self.options.kind != "llamacpp" and not self.authorized(request):
            return _error("Invalid API key", 401, "authentication_error")
        model = {
            "id": self.options.served_name,
            "object": "model",
            "created": self.created,
            "owned_by": self.options.kind,
        }
        return _json({"object": "list", "data": [model]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, required="messages")
        if isinstance(body, web.Response):
            return body
        messages = body.get("messages") or []
        if self.options.kind in ("vllm", "sglang"):  # they fetch a chat's media URLs
            failed = await load_media(messages, self.options.media_domains)
            if failed is not None:
                return _error(failed, 400)
        prompt = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        return await self._generate(request, body, prompt, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        return await self._generate(request, body, str(body.get("prompt", "")), chat=False)

    async def _generate(
        self, request: web.Request, body: dict[str, Any], prompt: str, *, chat: bool
    ) -> web.StreamResponse:
        count = self._tokens(body)
        words = [f"tok{i}" for i in range(count)]
        usage = {
            "prompt_tokens": max(1, len(prompt.split())),
            "completion_tokens": count,
            "total_tokens": max(1, len(prompt.split())) + count,
        }
        finish = "length" if count < self.knobs.completion_tokens else "stop"
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            if self.knobs.tokens_per_second > 0:
                await asyncio.sleep(count / self.knobs.tokens_per_second)
            text = " ".join(words)
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return _json(
                {
                    "id": ident,
                    "object": obj,
                    "created": int(time.time()),
                    "model": self.options.served_name,
                    "choices": [choice],
                    "usage": usage,
                }
            )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        include_usage = include_usage or self.usage_on_last_chunk
        return await self._stream(
            request, ident, words, finish, usage if include_usage else None, chat=chat
        )

    @property
    def usage_on_last_chunk(self) -> bool:
        """TensorFold puts usage on every stream's last chunk, the one with its finish
        reason (src/tensorfold/cuda/http.py); the others send it only with include_usage,
        in a chunk of its own."""
        return self.options.kind == "tensorfold"

    async def _stream(
        self,
        request: web.Request,
        ident: str,
        words: list[str],
        finish: str,
        usage: dict[str, int] | None,
        *,
        chat: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            await self._stream_chunks(response, ident, words, finish, usage, chat=chat)
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away: stop generating, as engines do, and say so in the log.
            print(f"stream {ident} cancelled by the client", flush=True)
            raise
        return response

    async def _stream_chunks(
        self,
        response: web.StreamResponse,
        ident: str,
        words: list[str],
        finish: str,
        usage: dict[str, int] | None,
        *,
        chat: bool,
    ) -> None:
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        async def send(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> None:
            data = {
                "id": ident,
                "object": chunk_obj,
                "created": created,
                "model": self.options.served_name,
                "choices": choices,
                **(extra or {}),
            }
            await response.write(b"data: " + json.dumps(data).encode() + b"\n\n")

        delay = 1 / self.knobs.tokens_per_second if self.knobs.tokens_per_second > 0 else 0
        for i, word in enumerate(words):
            if delay:
                await asyncio.sleep(delay)
            piece = word if i == 0 else " " + word
            if chat:
                delta: dict[str, Any] = {"content": piece}
                if i == 0:
                    delta["role"] = "assistant"
                await send([{"index": 0, "delta": delta, "finish_reason": None}])
            else:
                await send([{"index": 0, "text": piece, "finish_reason": None}])
            if self.knobs.die_mid_stream and i == 1:
                os._exit(4)  # the fault switch: the engine dies while streaming
        last: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            last["delta"] = {}
        else:
            last["text"] = ""
        if usage is not None and self.usage_on_last_chunk:
            await send([last], {"usage": usage})
        else:
            await send([last])
            if usage is not None:
                await send([], {"usage": usage})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()

    # -- the Responses API (create, retrieve, cancel, as vLLM serves it) ----------------------

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        given = body.get("input", "")
        if isinstance(given, list):
            given = " ".join(
                str(item.get("content", "")) for item in given if isinstance(item, dict)
            )
        limit = body.get("max_output_tokens")
        count = (
            max(1, min(int(limit), self.knobs.completion_tokens))
            if limit
            else self.knobs.completion_tokens
        )
        words = [f"tok{i}" for i in range(count)]
        ident = f"resp_{uuid.uuid4().hex}"
        prompt_tokens = max(1, len(str(given).split()))
        status = final_status(self.options.kind, cut_off=count < self.knobs.completion_tokens)
        message = {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex}",
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": " ".join(words), "annotations": []}],
        }
        usage = {
            "input_tokens": prompt_tokens,
            "output_tokens": count,
            "total_tokens": prompt_tokens + count,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }
        done: dict[str, Any] = {
            "id": ident,
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "model": self.options.served_name,
            "output": [message],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": usage,
        }
        if status == "incomplete":
            done["incomplete_details"] = {"reason": "max_output_tokens"}
        if body.get("store", True):
            self.responses[ident] = done
        if not body.get("stream"):
            return _json(done)
        return await self._stream_response(request, done, words)

    async def _stream_response(
        self, request: web.Request, done: dict[str, Any], words: list[str]
    ) -> web.StreamResponse:
        """The Response's events as this engine streams them (hostagent/sim/responses.py)."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        started = {**done, "status": "in_progress", "output": [], "usage": None}
        stream = ResponseStream(self.options.kind, started, done)

        async def send(events: list[dict[str, Any]]) -> None:
            for event in events:
                line = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
                await response.write(line.encode())

        await send(stream.opening())
        delay = 1 / self.knobs.tokens_per_second if self.knobs.tokens_per_second > 0 else 0
        for i, word in enumerate(words):
            if delay:
                await asyncio.sleep(delay)
            await send(stream.delta(word if i == 0 else " " + word))
        await send(stream.closing())
        await response.write_eof()
        return response

    def _stored(self, request: web.Request) -> dict[str, Any] | web.Response:
        if not self.authorized(request):
            return _error("Invalid API key", 401, "authentication_error")
        ident = request.match_info["ident"]
        found = self.responses.get(ident)
        return found if found is not None else _error(f"Response with id '{ident}' not found.", 404)

    async def get_response(self, request: web.Request) -> web.Response:
        found = self._stored(request)
        return found if isinstance(found, web.Response) else _json(found)

    async def cancel_response(self, request: web.Request) -> web.Response:
        found = self._stored(request)
        if isinstance(found, web.Response):
            return found
        if found["status"] == "completed":
            return _error("Cannot cancel a synchronous response.", 400)
        return _json(found)

    # -- audio: a multipart upload in, and binary speech out ---------------------------------

    async def transcription(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        audio = body.get("file")
        if not isinstance(audio, bytes):
            return _error("the form needs a `file` upload", 400)
        digest = hashlib.sha256(audio).hexdigest()[:12]
        return _json({"text": f"{len(audio)} bytes of audio, sha256 {digest}"})

    async def speech(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        text = str(body.get("input", "")).encode()
        samples = bytes(text[i % len(text)] for i in range(1600)) if text else b""
        header = b"RIFF" + (36 + len(samples)).to_bytes(4, "little") + b"WAVEfmt "
        header += (16).to_bytes(4, "little") + (1).to_bytes(2, "little") * 2
        header += (8000).to_bytes(4, "little") * 2 + (1).to_bytes(2, "little")
        header += (8).to_bytes(2, "little") + b"data" + len(samples).to_bytes(4, "little")
        return web.Response(body=header + samples, content_type="audio/wav")

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        inputs = body.get("input", "")
        items = inputs if isinstance(inputs, list) else [inputs]
        data = []
        for index, item in enumerate(items):
            seed = sum(str(item).encode()) or 1
            vector = [((seed * (k + 1)) % 997) / 997 for k in range(8)]
            data.append({"object": "embedding", "index": index, "embedding": vector})
        tokens = sum(max(1, len(str(item).split())) for item in items)
        return _json(
            {
                "object": "list",
                "data": data,
                "model": self.options.served_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    # -- health -----------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.ready.is_set():
            return _error("Loading model", 503, "unavailable_error")
        return web.Response(body=_HEALTH_OK[self.options.kind], content_type=JSON)

    # -- vLLM sleep mode (open, as in vLLM: --api-key guards only /v1) -------------------------

    async def sleep(self, request: web.Request) -> web.Response:
        level = int(request.query.get("level", "1"))
        if not self.options.sleep_mode:  # the engine's sleep raises without sleep mode
            return _error("Sleep mode is not enabled", 500, "InternalServerError")
        await self._release(keep_weights_in_ram=level == 1)
        return _json({"status": "sleeping", "level": level})  # serve/dev/sleep/api_router.py

    async def _release(self, *, keep_weights_in_ram: bool) -> None:
        """A park's time (a deep one's, when it has its own), then the memory given back."""
        deep = not keep_weights_in_ram
        seconds = self.knobs.deep_sleep_seconds if deep else None
        await asyncio.sleep(self.knobs.sleep_seconds if seconds is None else seconds)
        self.memory.release(keep_weights_in_ram=keep_weights_in_ram)
        self.reload_pending = deep and self.knobs.deep_wake_seconds is not None

    async def _take_wake_time(self) -> None:
        """A wake's time: never over (hang), held until the gate file exists, then its
        seconds (none when a deep wake's time is its reload's)."""
        if self.knobs.hang_on_wake:
            await asyncio.sleep(10**6)
        await _held_at(self.knobs.wake_gate)
        await asyncio.sleep(0 if self.reload_pending else self.knobs.wake_seconds)

    async def _take_reload_time(self) -> None:
        """A deep wake's time, with CAPYCTL_SIM_DEEP_WAKE_SECONDS: the weights read again."""
        if self.reload_pending and self.memory.weights_on_gpu:
            await asyncio.sleep(self.knobs.deep_wake_seconds or 0)

    def _woken(self) -> None:
        if self.memory.serving:
            self.reload_pending = False

    async def wake_up(self, request: web.Request) -> web.Response:
        tags = set(request.query.getall("tags", [])) or {"weights", "kv_cache"}
        await self._take_wake_time()
        self.memory.wake(tags)
        self._woken()
        return _json(
            {"status": "sleeping" if self.memory.sleeping else "awake", "tags": sorted(tags)}
        )

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return _json({"is_sleeping": self.memory.sleeping})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("method") != "reload_weights":
            return _error(f"unknown method {body.get('method')!r}", 400)
        await self._take_reload_time()
        if not self.memory.reload_weights():
            return _error("weights are not on the GPU: wake them first", 400)
        self._woken()
        return _json({"results": [None]})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    # -- SGLang memory saver (guarded by the API key, as in SGLang) -----------------------------

    async def release(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return _error("Invalid API key", 401, "authentication_error")
        if not self.options.sleep_mode:
            await asyncio.sleep(self.knobs.sleep_seconds)
            return _json(None)  # the no-op memory saver: nothing is given back
        await self._release(keep_weights_in_ram=self.options.cpu_backup)
        return _json(None)

    async def resume(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return _error("Invalid API key", 401, "authentication_error")
        await self._take_wake_time()
        if self.options.sleep_mode:
            self.memory.wake({"weights", "kv_cache"})
            self._woken()
        return _json(None)

    async def update_weights(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return _error("Invalid API key", 401, "authentication_error")
        await self._take_reload_time()
        if not self.memory.reload_weights():
            return _error("weights are not on the GPU: resume them first", 400)
        self._woken()
        return _json({"success": True, "message": "Succeeded to update model weights."})

    # -- routes some engines add: Anthropic messages, tokens, metrics, deleting a response --

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/messages``, Anthropic-shaped (non-streamed and streamed)."""
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        prompt = " ".join(
            str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict)
        )
        count = self._tokens(body)
        text = " ".join(f"tok{i}" for i in range(count))
        usage = {"input_tokens": max(1, len(prompt.split())), "output_tokens": count}
        done = {
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "type": "message",
            "role": "assistant",
            "model": self.options.served_name,
            "content": [{"type": "text", "text": text}],
            "stop_reason": "max_tokens" if count < self.knobs.completion_tokens else "end_turn",
            "stop_sequence": None,
            "usage": usage,
        }
        if not body.get("stream"):
            return _json(done)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events: list[tuple[str, dict[str, Any]]] = [
            ("message_start", {"message": {**done, "content": [], "stop_reason": None}}),
            ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}),
            ("content_block_stop", {"index": 0}),
            ("message_delta", {"delta": {"stop_reason": done["stop_reason"]}, "usage": usage}),
            ("message_stop", {}),
        ]
        for kind, data in events:
            await response.write(
                f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()
            )
        await response.write_eof()
        return response

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        given = body.get("prompt", body.get("content", body.get("messages", "")))
        tokens = [len(word) for word in str(given).split()]
        return _json({"count": len(tokens), "tokens": tokens, "max_model_len": 4096})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        tokens = body.get("tokens") or []
        return _json({"prompt": " ".join(f"tok{t}" for t in tokens)})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text, open like /health (as each engine serves it)."""
        name = f"{self.options.kind}_requests_total"
        text = f"# TYPE {name} counter\n{name} {self.requests}\n"
        return web.Response(text=text, content_type="text/plain")

    async def ping(self, request: web.Request) -> web.Response:
        return await self.health(request)

    async def version(self, request: web.Request) -> web.Response:
        from hostagent.sim.identity import sim_version  # noqa: PLC0415

        return _json({"version": sim_version(self.options.kind)})

    async def model_info(self, request: web.Request) -> web.Response:
        return _json({"model_path": self.options.source, "is_generation": True})

    async def delete_response(self, request: web.Request) -> web.Response:
        found = self._stored(request)
        if isinstance(found, web.Response):
            return found
        del self.responses[found["id"]]
        return _json({"id": found["id"], "object": "response", "deleted": True})

    # -- the app ---------------------------------------------------------------------------

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
        # -- TensorFold's prototype sleep API (hostagent/sim/tfsleep.py) --
        if self.options.kind == "tensorfold" and self.options.sleep_mode:
            TensorFoldSleep(self, sleep_token()).add_routes(app)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, app: web.Application) -> None:
        self.memory.clear()

    async def _load(self) -> None:
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
