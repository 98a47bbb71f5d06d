"""A simulated engine's routes that answer with generated content: the models list, chat
and completions (plain and streamed), the Responses API, Anthropic messages, embeddings,
audio, and tokens."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
import uuid
from typing import Any

from aiohttp import web

from hostagent.sim.engine_state import EngineState, _error, _held_at, _json
from hostagent.sim.media import load_media
from hostagent.sim.responses import ResponseStream, final_status


class InferenceRoutes(EngineState):
    """The routes a client calls to have the model answer."""

    # -- OpenAI routes ----------------------------------------------------------------------

    def adapter_cards(self) -> list[dict[str, Any]]:
        return []

    async def models(self, request: web.Request) -> web.Response:
        if self.options.kind != "llamacpp" and not self.authorized(request):
            return _error("Invalid API key", 401, "authentication_error")
        model = {
            "id": self.options.served_name,
            "object": "model",
            "created": self.created,
            "owned_by": self.options.kind,
        }
        return _json({"object": "list", "data": [model, *self.adapter_cards()]})

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
        """The answer once the request runs (hostagent/sim/load.py): its turn in the queue,
        then the prefill of what the prefix cache misses, both before the first token."""

        def gone() -> bool:
            return request.transport is None or request.transport.is_closing()

        async with self.scheduler.slot(gone) as held:
            if not held:
                print("a queued request left: its client went away", flush=True)
                return web.Response(status=499)  # nobody is there to read it
            tokens = prompt.split()
            cached = self.prefix_cache.lookup(tokens)
            if self.knobs.prefill_tokens_per_second > 0:
                await asyncio.sleep((len(tokens) - cached) / self.knobs.prefill_tokens_per_second)
            self.prefix_cache.insert(tokens)
            await _held_at(self.knobs.request_gate)
            return await self._answer(request, body, prompt, chat=chat)

    async def _answer(
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
                    "model": self.answer_model(body),
                    "choices": [choice],
                    "usage": usage,
                }
            )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        include_usage = include_usage or self.usage_on_last_chunk
        return await self._stream(
            request,
            ident,
            words,
            finish,
            usage if include_usage else None,
            chat=chat,
            model=self.answer_model(body),
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
        model: str,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        try:
            await self._stream_chunks(response, ident, words, finish, usage, chat=chat, model=model)
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
        model: str,
    ) -> None:
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        async def send(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> None:
            data = {
                "id": ident,
                "object": chunk_obj,
                "created": created,
                "model": model,
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

    async def delete_response(self, request: web.Request) -> web.Response:
        found = self._stored(request)
        if isinstance(found, web.Response):
            return found
        del self.responses[found["id"]]
        return _json({"id": found["id"], "object": "response", "deleted": True})

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

    # -- routes some engines add: Anthropic messages, tokens ----------------------------------

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
