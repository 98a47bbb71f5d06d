"""Recording traces: the gateway appends a tuple per request to a :class:`TraceBook` (on
the event loop, nothing else), and :class:`TraceWriter` writes them in batches on a
worker thread, then prunes the oldest rows past ``CAPYCTL_TRACE_MAX_ROWS``."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from datetime import UTC, datetime

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Max, Min

from capyctl.gateway.batches import one_line
from capyctl.traces.models import RequestTrace

logger = logging.getLogger("capyctl.gateway")

# (arrival as epoch seconds, model, key pk, stream, status, code or None, queued ms,
#  ms to the answer's head or None, duration ms, prompt tokens, completion tokens, switch)
Trace = tuple[float, str, int, bool, int, str | None, float, float | None, float, int, int, str]

KEPT_WHILE_DOWN = 100_000  # traces held in memory while the database does not answer
PRUNE_BATCH = 10_000  # rows deleted by one statement
_MAX_COLUMN = 2**31 - 1  # a PositiveIntegerField's bound on PostgreSQL


class TraceBook:
    """Traces in memory until they are written; at most ``limit`` of them, so a database
    that does not answer for long costs bounded memory: past it the oldest are dropped,
    counted in :attr:`dropped`, and that is logged once."""

    def __init__(self, limit: int = KEPT_WHILE_DOWN) -> None:
        self.limit = limit
        self._pending: deque[Trace] = deque(maxlen=limit)
        self.dropped = 0

    def add(self, trace: Trace) -> None:
        if len(self._pending) == self.limit:
            self._dropping(1)
        self._pending.append(trace)  # a full deque drops its oldest itself

    def take(self) -> deque[Trace]:
        pending, self._pending = self._pending, deque(maxlen=self.limit)
        return pending

    def put_back(self, pending: deque[Trace]) -> None:
        """Traces taken but not written: kept before the newer ones, within the limit."""
        kept = deque(pending, maxlen=self.limit)
        over = len(kept) + len(self._pending) - self.limit
        if over > 0:
            self._dropping(over)
        kept.extend(self._pending)
        self._pending = kept

    def _dropping(self, count: int) -> None:
        if not self.dropped:
            logger.warning("traces: the database has not answered for %d of them; the "
                           "oldest are dropped from now on", self.limit)  # fmt: skip
        self.dropped += count


def _column(value: float) -> int:
    """Milliseconds or tokens as a column holds them: whole, not negative, bounded (a
    value out of range would fail its whole batch again and again)."""
    return min(max(round(value), 0), _MAX_COLUMN)


def _row(trace: Trace) -> RequestTrace:
    at, model, key, stream, status, code, queued, ttfb, duration, prompt, completion, switch = trace
    return RequestTrace(
        at=datetime.fromtimestamp(at, UTC),
        model=model,
        key_pk=key,
        stream=stream,
        status=status,
        code=code or "",
        queued_ms=_column(queued),
        ttfb_ms=None if ttfb is None else _column(ttfb),
        duration_ms=_column(duration),
        prompt_tokens=_column(prompt),
        completion_tokens=_column(completion),
        switch=switch,
    )


class TraceWriter:
    """Writes a batch of traces in one INSERT, then deletes the oldest rows past
    ``TRACE_MAX_ROWS`` (runs on a worker thread, one batch at a time).

    The INSERT is all or nothing: a batch that fails is written not at all, and is tried
    again whole. A prune that fails after it (the rows are written) is logged once and
    done after the next write: the batch is not written twice for it.

    Ids only grow, so the rows to go are those more than the bound below the newest id:
    no COUNT(*), and, while the table is within its bound, no query at all beyond the
    INSERT. The oldest id left is remembered (read once); a row deleted by another
    process meanwhile only makes a delete find nothing, and then the oldest is read again.
    """

    def __init__(self) -> None:
        self._oldest: int | None = None
        self._prune_failing = False

    def __call__(self, pending: Iterable[Trace]) -> None:
        try:
            with transaction.atomic():
                made = RequestTrace.objects.bulk_create([_row(trace) for trace in pending])
            # Written: from here on nothing may fail the batch (it would be written again).
            try:
                ids = [row.pk for row in made]
                newest = max(ids) if ids and None not in ids else _newest_id()
                if newest is not None:
                    self._prune(newest, int(settings.CAPYCTL["TRACE_MAX_ROWS"]))
            except Exception as exc:
                self._oldest = None  # read again next time
                if not self._prune_failing:
                    self._prune_failing = True
                    logger.warning("traces written, but the oldest past the bound were not "
                                   "deleted (%s); tried again after the next write",
                                   one_line(exc))  # fmt: skip
            else:
                self._prune_failing = False
        finally:
            connection.close()

    def _prune(self, newest: int, max_rows: int) -> None:
        keep_from = newest - max_rows + 1  # ids below this go
        if keep_from <= 1:  # ids start at 1: not that many rows were ever written
            return
        if self._oldest is None:
            self._oldest = RequestTrace.objects.aggregate(oldest=Min("id"))["oldest"]
        while self._oldest is not None and self._oldest < keep_from:
            below = min(keep_from, self._oldest + PRUNE_BATCH)
            deleted, _ = RequestTrace.objects.filter(id__lt=below).delete()
            if deleted:
                self._oldest = below
            else:  # another process pruned them: start from what is left
                oldest = RequestTrace.objects.aggregate(oldest=Min("id"))["oldest"]
                self._oldest = keep_from if oldest is None else oldest


def _newest_id() -> int | None:
    newest: int | None = RequestTrace.objects.aggregate(newest=Max("id"))["newest"]
    return newest
