"""Writes kept off the request path: what requests leave in a book in memory (usage
counts, traces) is written once a second in one go, on a worker thread."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sized
from typing import Generic, Protocol, TypeVar

logger = logging.getLogger("capyctl.gateway")

Pending = TypeVar("Pending", bound=Sized)


class Book(Protocol[Pending]):
    def take(self) -> Pending:
        """Everything recorded since the last take (the book is empty after)."""

    def put_back(self, pending: Pending) -> None:
        """What was taken and not written: kept for the next write."""


def one_line(exc: BaseException) -> str:
    """What a failed write said, on one line (PostgreSQL adds lines of context)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class BatchedWrites(Generic[Pending]):
    """Writes ``book`` with ``write`` (on a worker thread) a second after :meth:`soon` is
    first called, so many requests cost one write. What arrives while a write is under way
    is written a second after it arrived (or at once after that write, if it took longer),
    with no request after it. A write that fails (the database does not answer) puts its
    batch back and is tried again a second later; that is logged once, and once more when
    a write succeeds again. One write at a time."""

    def __init__(self, book: Book[Pending], write: Callable[[Pending], None], what: str) -> None:
        self._book = book
        self._write = write
        self._what = what
        self._task: asyncio.Task[None] | None = None
        self._due: float | None = None  # when what the book holds is to be written
        self._writing = False
        self._closing = False
        self._failing = False

    def soon(self) -> None:
        """Write what the book holds within a second (on the event loop: one check)."""
        if self._due is None:
            self._due = asyncio.get_running_loop().time() + 1.0
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._writes())

    async def _writes(self) -> None:
        """Write while anything is due: one write per second, however many requests."""
        loop = asyncio.get_running_loop()
        while self._due is not None and not self._closing:
            await asyncio.sleep(max(self._due - loop.time(), 0.0))
            self._due = None  # what arrives from now on is due a second after it arrives
            if not await self._flush():
                self._due = loop.time() + 1.0

    async def _flush(self, *, keep: bool = True) -> bool:
        """Write what is pending; whether it was written (or nothing was pending)."""
        pending = self._book.take()
        if not pending:
            return True
        self._writing = True
        try:
            await asyncio.get_running_loop().run_in_executor(None, self._write, pending)
        except Exception as exc:
            if not keep:
                logger.warning("%s not written as the server stops (%s)", self._what, one_line(exc))
                return False
            self._book.put_back(pending)
            if not self._failing:
                self._failing = True
                logger.warning("%s not written (%s); kept in memory and tried again every "
                               "second", self._what, one_line(exc))  # fmt: skip
            return False
        finally:
            self._writing = False
        if self._failing:
            self._failing = False
            logger.warning("%s written again", self._what)
        return True

    async def close(self) -> None:
        """Write what is pending now (the server stops): not a second later, and not kept
        if the write fails. A write under way ends first (two never run at once)."""
        self._closing = True
        task = self._task
        if task is not None and not task.done():
            if not self._writing:
                task.cancel()  # it was waiting for its second
            await asyncio.gather(task, return_exceptions=True)
        await self._flush(keep=False)
