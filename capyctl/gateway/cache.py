"""A small cache of database reads for the gateway, kept warm in the background.

Names (model names, key ids) used in the last ``keep_warm`` seconds (``KEEP_WARM_SECONDS``
unless told) are re-read together, in one batch, every ``soft`` seconds by one background
task, so requests find fresh values and never wait on the database. A value older than
``hard`` is never used: the request waits for a read. Names that need a read at the same
moment share one (one query per ``CHUNK`` names, however many requests wait). That bounds
how stale anything can be, e.g. how long a revoked key keeps working, on every process.
While the database does not answer, the last value read of a name stands (nothing can
change it meanwhile), so ready models keep answering their callers.

What is kept is bounded, so names nobody can own (random key ids) cannot grow it: at most
``max_names`` names are kept warm, the least recently used giving way; with
``warm_missing`` off, a name found missing is only remembered as missing, for
``miss_seconds``, in a bounded list of its own, and never re-read in the background.

A caller may also ask for a name in the slow lane (``get(name, slow=True)``): what is in
memory is answered at once; anything else waits for one read shared by everything asked
in the slow lane, at most one every ``slow_seconds``, so clients that are being slowed
down cost the database a bounded number of reads however fast they ask.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from asgiref.sync import sync_to_async
from django.db import connection

from capyctl.access.guessing import RecentMisses
from capyctl.scheduler.gateway_api import is_control_plane_error

logger = logging.getLogger("capyctl.gateway")
T = TypeVar("T")
KEEP_WARM_SECONDS = 60.0  # the default; see WarmCache's keep_warm
SLOW_LANE_SECONDS = 0.25
# Names per query: far below any database's limit on bound variables (SQLite's is 32,766).
CHUNK = 500


class WarmCache(Generic[T]):
    def __init__(
        self,
        fetch_many: Callable[[list[str]], dict[str, T]],
        *,
        soft: float,
        hard: float,
        max_names: int = 10_000,
        warm_missing: bool = True,
        miss_seconds: float = 5.0,
        keep_warm: float | None = None,
        slow_seconds: float = SLOW_LANE_SECONDS,
    ) -> None:
        self._fetch_many = fetch_many
        self.soft = soft
        self.hard = hard
        self.max_names = max_names
        self.warm_missing = warm_missing
        self.keep_warm = keep_warm  # None: KEEP_WARM_SECONDS
        self.slow_seconds = slow_seconds
        # How long a read takes here, lately (an average, moving): what a caller may pad a
        # quicker answer to, so that whether a read was needed does not show.
        self.read_seconds = 0.001
        self._values: dict[str, T | None] = {}
        self._read_at: dict[str, float] = {}  # when the read that gave the value began
        self._used_at: dict[str, float] = {}  # in order of use: the least recent first
        self._missing = RecentMisses(seconds=miss_seconds, kept=max_names)
        self._reading: dict[str, asyncio.Future[T | None]] = {}
        self._batch: dict[str, asyncio.Future[T | None]] = {}
        self._batch_task: asyncio.Future[None] | None = None
        self._slow_batch: dict[str, asyncio.Future[T | None]] = {}
        self._slow_task: asyncio.Future[None] | None = None
        self._warmer: asyncio.Task[None] | None = None

    def peek(self, name: str) -> tuple[bool, T | None]:
        """``(known, value)`` from memory alone: never reads, never keeps ``name``."""
        now = time.monotonic()
        if name in self._missing:
            return True, None
        if now - self._read_at.get(name, -1e9) <= self.hard:
            return True, self._values.get(name)
        return False, None

    async def get(self, name: str, *, fresh: bool = False, slow: bool = False) -> T | None:
        """The value (None: there is none); ``fresh`` waits for a read begun now; ``slow``
        waits, if a read is needed, for the slow lane's next one."""
        now = time.monotonic()
        if not fresh and name in self._missing:
            return None
        known = now - self._read_at.get(name, -1e9) <= self.hard
        # A name in the slow lane is kept only once a read finds it: until then the warm
        # set neither re-reads it nor lets a kept name go for it.
        if not slow or known or name in self._used_at:
            self._use(name, now)
        if self._warmer is None or self._warmer.done():
            self._warmer = asyncio.ensure_future(self._keep_warm())
        if not fresh and known:
            return self._values[name]
        reading = self._reading.get(name)
        if fresh:
            reading = asyncio.ensure_future(self._read_one(name))
            self._reading[name] = reading
        elif reading is None:
            reading = self._queue(name, slow=slow)
        try:
            return await asyncio.shield(reading)
        except Exception as exc:
            # The database does not answer: the last value read stands until it does (a
            # change made meanwhile could not have been made). A name never read fails.
            if name in self._read_at and is_control_plane_error(exc):
                return self._values.get(name)
            raise

    def _use(self, name: str, now: float) -> None:
        used = self._used_at
        used.pop(name, None)  # re-inserted at the end: the dict stays in order of use
        used[name] = now
        if len(used) > self.max_names:
            self._forget(next(iter(used)))

    def _forget(self, name: str) -> None:
        for table in (self._used_at, self._values, self._read_at):
            table.pop(name, None)

    def _queue(self, name: str, *, slow: bool = False) -> asyncio.Future[T | None]:
        """A future for ``name``'s value, read with every other name queued this turn (in
        the slow lane: with every other one queued there until its next read)."""
        future: asyncio.Future[T | None] = asyncio.get_running_loop().create_future()
        self._reading[name] = future
        if slow:
            self._slow_batch[name] = future
            if len(self._slow_batch) == 1:
                self._slow_task = asyncio.ensure_future(self._read_batch(slow=True))
            return future
        self._batch[name] = future
        if len(self._batch) == 1:  # kept, so the task is not collected while it runs
            self._batch_task = asyncio.ensure_future(self._read_batch())
        return future

    async def _read_batch(self, *, slow: bool = False) -> None:
        if slow:  # one read a period, whatever is queued meanwhile
            await asyncio.sleep(self.slow_seconds)
            batch, self._slow_batch = self._slow_batch, {}
        else:
            await asyncio.sleep(0)  # let the requests of this turn join the batch
            batch, self._batch = self._batch, {}
        try:
            found = await self._read(list(batch), adopt=slow)
        except Exception as exc:
            for name, future in batch.items():
                self._reading.pop(name, None)
                if not future.done():
                    future.set_exception(exc)
                    future.exception()  # retrieved: whoever waits gets it, no stray warning
            return
        for name, future in batch.items():
            self._reading.pop(name, None)
            if not future.done():
                future.set_result(found.get(name))

    async def _read_one(self, name: str) -> T | None:
        try:
            return (await self._read([name])).get(name)
        finally:
            self._reading.pop(name, None)

    def _fetch_chunks(self, names: list[str]) -> dict[str, T]:
        found: dict[str, T] = {}
        try:
            for start in range(0, len(names), CHUNK):
                found.update(self._fetch_many(names[start : start + CHUNK]))
        except Exception:
            # A connection the database dropped (a restart) stays broken on this thread
            # until closed: the next read connects afresh.
            connection.close()
            raise
        return found

    async def _read(self, names: list[str], *, adopt: bool = False) -> dict[str, T]:
        """Read ``names``; keep the values of those still kept (``adopt``: of those found
        too, as the slow lane's names are kept only once found)."""
        began = time.monotonic()
        # On the executor's threads, each of which keeps its database connection.
        found = await sync_to_async(self._fetch_chunks, thread_sensitive=False)(names)
        self.read_seconds += (time.monotonic() - began - self.read_seconds) / 16
        for name in names:
            if began < self._read_at.get(name, -1e9):
                continue  # never replace a newer read
            value = found.get(name)
            if value is None and not self.warm_missing:
                self._forget(name)
                self._missing.add(name, began)
            elif name in self._used_at or (adopt and value is not None):
                if name not in self._used_at:  # found in the slow lane: kept from now on
                    self._use(name, began)
                # (otherwise kept only if not let go meanwhile: what is kept stays bounded)
                self._values[name] = value
                self._read_at[name] = began
        return found

    async def _keep_warm(self) -> None:
        failing = False
        while self._used_at:
            await asyncio.sleep(self.soft)
            keep = KEEP_WARM_SECONDS if self.keep_warm is None else self.keep_warm
            cutoff = time.monotonic() - keep
            while self._used_at:  # in order of use: the stale ones are at the front
                name, used = next(iter(self._used_at.items()))
                if used >= cutoff:
                    break
                self._forget(name)
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
        tasks = [task for task in (self._warmer, self._slow_task) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
