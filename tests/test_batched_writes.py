"""What requests leave in memory (usage counts, traces) is written once a second off the
request path: within about a second whatever else happens, and exactly once, a batch that
fails being all or nothing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import sync_to_async

from capyctl.access.models import ApiKey
from capyctl.access.services import issue_api_key
from capyctl.gateway.batches import BatchedWrites
from capyctl.gateway.usage import UsageBook, UsageCell, write_usage
from capyctl.traces.models import RequestTrace
from capyctl.traces.recording import Trace, TraceBook, TraceWriter
from tests.refusals import refused


def _counts(pk: int) -> tuple[int, int, int]:
    key = ApiKey.objects.get(pk=pk)
    return key.request_count, key.prompt_tokens, key.completion_tokens


def _trace(at: datetime) -> Trace:
    return (at.timestamp(), "chat", 7, False, 200, None, 0.0, 5.0, 9.0, 3, 8, "")


async def _until(check: Callable[[], bool], what: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"not within {seconds}s: {what}"
        await asyncio.sleep(0.02)


@pytest.mark.django_db(transaction=True)
async def test_what_arrives_during_a_write_is_written_about_a_second_later(bob, database_threads):
    """A write takes 0.3 s (a slow database); a request ends during it. Its count is
    written about a second later with no request after it (it once waited in memory
    for the next request, however long that took)."""
    key = (await sync_to_async(issue_api_key)("bob"))[0]
    writing: list[float] = []

    def slow_write(pending: dict[UsageCell, list[float]]) -> None:
        writing.append(time.monotonic())
        time.sleep(0.3)
        write_usage(pending)

    book = UsageBook()
    writes = BatchedWrites(book, slow_write, "usage")
    book.add(key.pk, 3, 8)
    writes.soon()
    await _until(lambda: bool(writing), "the first write began")
    book.add(key.pk, 5, 13)  # ends while the first write is under way
    writes.soon()
    arrived = time.monotonic()
    while await sync_to_async(_counts)(key.pk) != (2, 8, 21):
        assert time.monotonic() - arrived < 3, "a request that ended during a write is not written"
        await asyncio.sleep(0.02)
    took = time.monotonic() - arrived
    assert len(writing) == 2
    await writes.close()
    logging.getLogger(__name__).info("written %.2fs after it arrived during a write", took)


@pytest.mark.django_db(transaction=True)
async def test_a_usage_batch_that_fails_half_way_is_counted_once(bob, database_threads, caplog):
    """The database refuses the second key's update after the first key's went through:
    the batch is kept and written again, and each key's counts are exact (the first key's
    requests were once counted twice)."""
    first, second = [(await sync_to_async(issue_api_key)("bob", name=n))[0] for n in "ab"]
    book = UsageBook()
    writes = BatchedWrites(book, write_usage, "usage")
    refusing = refused(ApiKey._meta.db_table, "UPDATE", f"NEW.id = {second.pk}")
    await sync_to_async(refusing.__enter__)()
    try:
        with caplog.at_level(logging.WARNING, logger="capyctl.gateway"):
            book.add(first.pk, 3, 8)
            book.add(second.pk, 5, 13)
            writes.soon()
            await _until(lambda: "usage not written" in caplog.text, "the write failed")
            assert "usage not written (refused by the database); kept in memory" in caplog.text
    finally:
        await sync_to_async(refusing.__exit__)(None, None, None)
    await writes.close()  # what is kept is written now
    assert await sync_to_async(_counts)(first.pk) == (1, 3, 8)
    assert await sync_to_async(_counts)(second.pk) == (1, 5, 13)
    assert await ApiKey.objects.filter(last_used_at__isnull=False).acount() == 2


@pytest.mark.django_db(transaction=True)
async def test_a_prune_that_fails_leaves_the_written_traces_written_once(
    database_threads, settings, caplog
):
    """Traces are written, then the delete of the oldest past the bound is refused: the
    batch stays written, once (it was once put back whole and written again), the log
    says so, and the next batch's prune catches up."""
    settings.CAPYCTL = {**settings.CAPYCTL, "TRACE_MAX_ROWS": 8}
    now = datetime.now(UTC)
    moments = [now + timedelta(seconds=s) for s in range(11)]
    writer = TraceWriter()
    await sync_to_async(writer)([_trace(at) for at in moments[:6]])  # within the bound
    book = TraceBook()
    writes = BatchedWrites(book, writer, "traces")
    refusing = refused(RequestTrace._meta.db_table, "DELETE")
    await sync_to_async(refusing.__enter__)()
    try:
        with caplog.at_level(logging.WARNING, logger="capyctl.gateway"):
            for at in moments[6:10]:  # ten rows: two past the bound
                book.add(_trace(at))
            writes.soon()
            await _until(lambda: "refused by the database" in caplog.text, "the prune failed")
    finally:
        await sync_to_async(refusing.__exit__)(None, None, None)
    await writes.close()  # whatever was kept is written now

    def written() -> list[datetime]:
        return list(RequestTrace.objects.order_by("id").values_list("at", flat=True))

    assert await sync_to_async(written)() == moments[:10]  # each once, none deleted yet
    await sync_to_async(writer)([_trace(moments[10])])
    assert await sync_to_async(written)() == moments[3:]  # the newest eight
    said = [r.getMessage() for r in caplog.records if r.name == "capyctl.gateway"]
    assert said == [
        (
            "traces written, but the oldest past the bound were not deleted (refused by the "
            "database); tried again after the next write"
        )
    ]
