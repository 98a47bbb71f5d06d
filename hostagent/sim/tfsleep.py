"""The simulated TensorFold's prototype sleep API (its ``docs/model-sleep.md``).

With ``--enable-sleep-mode`` (which needs ``TENSORFOLD_SLEEP_TOKEN`` in its environment),
``POST /sleep?level=2`` drops the weights and caches, ``POST /wake_up`` reloads them and
``GET /is_sleeping`` reports; each also under ``/v1``. They take the sleep token as a
bearer (401 otherwise), refuse a browser ``Origin`` (403), and answer the lifecycle:
``state``, ``ready``, ``is_sleeping``, ``level``, ``active_requests``, ``last_error``,
``memory``. Level 1 is not implemented (400); a transition while another runs is 409.
Without the flag the routes do not exist (404). ``/health`` stays 200 while it sleeps:
readiness is ``ready``.
"""

from __future__ import annotations

import asyncio
import hmac
import os
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from hostagent.sim.server import SimEngine

TOKEN_VARIABLE = "TENSORFOLD_SLEEP_TOKEN"  # noqa: S105 - a variable's name


def sleep_token() -> str:
    """The token the real server requires at start with ``--enable-sleep-mode``."""
    token = os.environ.get(TOKEN_VARIABLE, "")
    if not token:
        raise SystemExit(f"--enable-sleep-mode requires a secret in {TOKEN_VARIABLE}")
    return token


class TensorFoldSleep:
    def __init__(self, engine: SimEngine, token: str) -> None:
        self.engine = engine
        self.token = token
        self.state = "awake"
        self.last_error: str | None = None
        self.busy = asyncio.Lock()

    def _answer(self, status: int = 200) -> web.Response:
        memory = self.engine.memory
        held = sum(memory.gpu_bytes().values()) if memory.devices else 0
        body: dict[str, Any] = {
            "state": self.state,
            "ready": self.state == "awake" and memory.serving,
            "is_sleeping": self.state == "sleeping",
            "level": 2 if self.state == "sleeping" else None,
            "active_requests": 0,
            "last_error": self.last_error,
            "memory": {"allocated_bytes": held, "reserved_bytes": held},
        }
        return web.json_response(body, status=status)

    def _refusal(self, request: web.Request) -> web.Response | None:
        if request.headers.get("Origin"):
            return web.json_response({"error": "browser requests are refused"}, status=403)
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return web.json_response({"error": "invalid sleep token"}, status=401)
        return None

    async def sleep(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        if request.query.get("level", "2") != "2":
            return web.json_response({"error": "only level 2 is implemented"}, status=400)
        if self.busy.locked():
            return web.json_response({"error": "a transition is running"}, status=409)
        async with self.busy:
            if self.state != "sleeping":
                self.state = "draining"
                await self.engine._release(keep_weights_in_ram=False)
                self.state = "sleeping"
        return self._answer()

    async def wake_up(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        if self.busy.locked():
            return web.json_response({"error": "a transition is running"}, status=409)
        async with self.busy:
            if self.state == "sleeping":
                self.state = "waking"
                await self.engine._take_wake_time()
                self.engine.memory.wake({"weights", "kv_cache"})
                await self.engine._take_reload_time()
                self.engine.memory.reload_weights()
                self.engine._woken()
                self.state = "awake"
        return self._answer()

    async def is_sleeping(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        return refused if refused is not None else self._answer()

    def add_routes(self, app: web.Application) -> None:
        for prefix in ("", "/v1"):
            app.router.add_post(f"{prefix}/sleep", self.sleep)
            app.router.add_post(f"{prefix}/wake_up", self.wake_up)
            app.router.add_get(f"{prefix}/is_sleeping", self.is_sleeping)
