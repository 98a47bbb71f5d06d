"""What makes a simulated engine saturate: a scheduler that runs at most so many requests
at once and queues the rest first in, first out (CAPYCTL_SIM_MAX_CONCURRENCY), and a
prefix cache whose misses cost prefill time before the first token
(CAPYCTL_SIM_PREFIX_CACHE, CAPYCTL_SIM_PREFILL_TOKENS_PER_SECOND)."""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

BLOCK_TOKENS = 16  # vLLM's default --block-size: the cache holds whole blocks only


class Scheduler:
    """At most ``limit`` requests running (0: no limit); the others wait in arrival order.
    A request that leaves while waiting (its client gone, or its task cancelled) takes no
    slot; a slot given back goes to the next waiting request."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running = 0
        self._queue: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @asynccontextmanager
    async def slot(self, gone: Callable[[], bool]) -> AsyncIterator[bool]:
        """Hold a slot for the block, which is told False if the client left while
        waiting (``gone``, asked while waiting: aiohttp does not cancel a handler when
        its client goes) and then holds none."""
        held = await self._take(gone)
        try:
            yield held
        finally:
            if held:
                self._give_back()

    async def _take(self, gone: Callable[[], bool]) -> bool:
        if not self.limit or (self.running < self.limit and not self._queue):
            self.running += 1
            return True
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(turn)
        try:
            while not turn.done():
                await asyncio.wait([turn], timeout=0.05)
                if not turn.done() and gone():
                    self._queue.remove(turn)
                    return False
        except BaseException:  # cancelled while waiting
            if turn.done():
                self._give_back()  # handed a slot just as it left: pass it on
            else:
                self._queue.remove(turn)
            raise
        return True

    def _give_back(self) -> None:
        if self._queue:
            self._queue.popleft().set_result(None)  # the slot passes on: running stays
        else:
            self.running -= 1


class PrefixCache:
    """vLLM's automatic prefix caching, in whitespace tokens: a prompt's whole blocks,
    each keyed by a hash of everything up to its end; a prompt's cached part is its
    longest run of leading blocks in the cache. Least recently used blocks go first
    beyond ``capacity`` tokens (0: no cache)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of those, tokens found cached
        self._blocks: OrderedDict[str, None] = OrderedDict()

    @staticmethod
    def _keys(tokens: list[str]) -> list[str]:
        keys, parent = [], ""
        for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            block = " ".join(tokens[start : start + BLOCK_TOKENS])
            parent = hashlib.sha256(f"{parent}\0{block}".encode()).hexdigest()
            keys.append(parent)
        return keys

    def lookup(self, tokens: list[str]) -> int:
        """The tokens of ``tokens`` found cached, counted in the queries and hits."""
        if not self.capacity:
            return 0
        found = 0
        for key in self._keys(tokens):
            if key not in self._blocks:
                break
            found += BLOCK_TOKENS
        self.queries += len(tokens)
        self.hits += found
        return found

    def insert(self, tokens: list[str]) -> None:
        """Cache a served prompt's blocks, its tail touched first so that it is evicted
        before its head (vLLM frees a request's blocks in reverse order)."""
        if not self.capacity:
            return
        for key in reversed(self._keys(tokens)):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) * BLOCK_TOKENS > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
