"""A simulated engine's routes that report on it and control it: health, metrics, version
and model info; vLLM's sleep mode and SGLang's memory saver (park, wake, reload)."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from hostagent.sim.engine_state import JSON, EngineState, _error, _held_at, _json

_HEALTH_OK = {
    "vllm": b"",
    "sglang": b"",
    "llamacpp": b'{"status":"ok"}',
    "tensorfold": b'{"status":"ok"}',
}


class ControlRoutes(EngineState):
    """Health and information, and the routes that park and wake the engine."""

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
        self.prefix_cache.clear()
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

    # -- what some engines add: metrics, ping, version, model info ---------------------------

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text, open like /health (as each engine serves it): the requests
        taken, those running and waiting, and the prefix cache's queries and hits in
        prompt tokens (hostagent/sim/load.py), under vLLM's own names and labels on the
        vLLM kind (vllm/v1/metrics/loggers.py) and the same names under ``sim:`` on the
        others."""
        name = f"{self.options.kind}_requests_total"
        lines = [f"# TYPE {name} counter", f"{name} {self.requests}"]
        model = json.dumps(self.options.served_name)
        vllm = self.options.kind == "vllm"
        prefix, labels = ("vllm", f'{{model_name={model},engine="0"}}') if vllm else ("sim", "")
        for metric, kind, value in (
            ("num_requests_running", "gauge", self.scheduler.running),
            ("num_requests_waiting", "gauge", self.scheduler.waiting),
            ("prefix_cache_queries", "counter", self.prefix_cache.queries),
            ("prefix_cache_hits", "counter", self.prefix_cache.hits),
        ):
            sample = f"{prefix}:{metric}{'_total' if kind == 'counter' else ''}"
            lines += [f"# TYPE {prefix}:{metric} {kind}", f"{sample}{labels} {float(value)}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def ping(self, request: web.Request) -> web.Response:
        return await self.health(request)

    async def version(self, request: web.Request) -> web.Response:
        from hostagent.sim.identity import sim_version  # noqa: PLC0415

        return _json({"version": sim_version(self.options.kind)})

    async def model_info(self, request: web.Request) -> web.Response:
        return _json({"model_path": self.options.source, "is_generation": True})
