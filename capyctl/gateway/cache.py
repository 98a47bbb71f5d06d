"""A small cache of database reads for the gateway, kept warm in the background.

Names (model names, key ids) used in the last ``KEEP_WARM_SECONDS`` are re-read together,
in one batch, every ``soft`` seconds by one background task, so requests find fresh values
and never wait on the database. A value older than ``hard`` is never used: the request
waits for a read (one read per name, however many requests wait for it). That bounds how
stale anything can be, e.g. how long a revoked key keeps working, on every process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from asgiref.sync import sync_to_async

logger = logging.getLogger("capyctl.gateway")
T = TypeVar("T")
KEEP_WARM_SECONDS = 60.0


class WarmCache(Generic[T]):
    def __init__(
        self, fetch_many: Callable[[list[str]], dict[str, T]], *, soft: float, hard: float
    ) -> None:
        self._fetch_many = fetch_many
        self.soft = soft
        self.hard = hard
        self._values: dict[str, T | None] = {}
        self._read_at: dict[str, float] = {}  # when the read that gave the value began
        self._used_at: dict[str, float] = {}
        self._reading: dict[str, asyncio.Future[T | None]] = {}
        self._warmer: asyncio.Task[None] | None = None

    async def get(self, name: str, *, fresh: bool = False) -> T | None:
        """The value (None: there is none); ``fresh`` waits for a read begun now."""
        now = time.monotonic()
        self._used_at[name] = now
        if self._warmer is None or self._warmer.done():
            self._warmer = asyncio.ensure_future(self._keep_warm())
        if not fresh and now - self._read_at.get(name, -1e9) <= self.hard:
            return self._values[name]
        reading = self._reading.get(name)
        if reading is None or fresh:
            reading = asyncio.ensure_future(self._read_one(name))
            self._reading[name] = reading
        return await asyncio.shield(reading)

    async def _read_one(self, name: str) -> T | None:
        try:
            await self._read([name])
            return self._values[name]
        finally:
            self._reading.pop(name, None)

    async def _read(self, names: list[str]) -> None:
        began = time.monotonic()
        # On the executor's threads, each of which keeps its database connection.
        found = await sync_to_async(self._fetch_many, thread_sensitive=False)(names)
        for name in names:
            if began >= self._read_at.get(name, -1e9):  # never replace a newer read
                self._values[name] = found.get(name)
                self._read_at[name] = began

    async def _keep_warm(self) -> None:
        failing = False
        while self._used_at:
            await asyncio.sleep(self.soft)
            cutoff = time.monotonic() - KEEP_WARM_SECONDS
            for name in [n for n, used in self._used_at.items() if used < cutoff]:
                for table in (self._used_at, self._values, self._read_at):
                    table.pop(name, None)
            names = list(self._used_at)
            if names:
                try:
                    await self._read(names)
                    failing = False
                except Exception as exc:
                    # Values age out past ``hard``; requests then read for themselves and
                    # get the error. Said once a failing streak, not four times a second.
                    if not failing:
                        logger.warning("the gateway could not re-read its cache: %s", exc)
                    failing = True

    async def close(self) -> None:
        if self._warmer is not None:
            self._warmer.cancel()
            await asyncio.gather(self._warmer, return_exceptions=True)
