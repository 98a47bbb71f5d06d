"""The classes of the requests that want each model: what priority classes decide turns on.

The gateway counts, per deployment, the requests of each class (``interactive`` or
``batch``: a key's, else its team's) that wait for it or are in flight on it
(:func:`begin`, :func:`end`: a dictionary's update, nothing more on the request path). The
scheduler reads every process's counts (:func:`demand`) when it decides turns
(:mod:`capyctl.scheduler.turn_rules`).

A model whose last request ended a moment ago still counts as busy (a client that loops
sends its next one within it): its class is then that of the request that ended last,
kept for :data:`RECENT_SECONDS`.

Standalone keeps them in the process that serves ``/v1``, where the scheduler runs too.
Server mode: each API process publishes its own counts in one field of a Redis hash (a
thread, at most :data:`PUBLISH_SECONDS` after a change and every second while any is
not zero); a field not renewed for :data:`STALE_SECONDS` was left by a process that is
gone. When the counts cannot be read (Redis does not answer; a process that does not
serve ``/v1``, in standalone), :func:`demand` answers None and turns are decided as
without classes: classes only ever order who waits, so a guess is not needed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any

from django.conf import settings

from capyctl.scheduler import redislink, requests_in_progress

logger = logging.getLogger("capyctl.scheduler")

_KEY = "capyctl:classes"  # a hash: process -> {"at": epoch, "counts": {deployment: [i, b]}}
PUBLISH_SECONDS = 0.05  # a change is published this soon (changes meanwhile go with it)
RENEW_SECONDS = 1.0
STALE_SECONDS = 3.0
# How long the class of a deployment's last ended request is kept (past server mode's
# busy grace: capyctl.scheduler.steps.busy_grace).
RECENT_SECONDS = 2.0

# deployment -> (interactive, batch, whether the request that ended last was batch)
Counts = dict[int, tuple[int, int, bool]]


class Classes:
    """This process's counts, and (server mode) the thread that publishes them."""

    def __init__(self, url: str | None) -> None:
        self._counts: dict[int, list[int]] = {}
        self._last: dict[int, tuple[bool, float]] = {}  # class and time.monotonic() of an end
        self._lock = threading.Lock()
        self._url = url
        self._changed = threading.Event()
        self._thread: threading.Thread | None = None
        self._process = uuid.uuid4().hex
        self._client: Any = None
        self._closed = threading.Event()

    def _redis(self) -> Any:
        if self._client is None:
            self._client = redislink.client(str(self._url))
        return self._client

    def begin(self, deployment_id: int, batch: bool) -> None:
        with self._lock:
            counts = self._counts.setdefault(deployment_id, [0, 0])
            counts[batch] += 1
        self._publish_soon()

    def end(self, deployment_id: int, batch: bool) -> None:
        with self._lock:
            counts = self._counts.get(deployment_id)
            if counts is None:
                return
            counts[batch] = max(counts[batch] - 1, 0)
            if counts == [0, 0]:
                del self._counts[deployment_id]
            self._last[deployment_id] = (batch, time.monotonic())
        self._publish_soon()

    def own(self) -> Counts:
        with self._lock:
            now = time.monotonic()
            for pk in [pk for pk, (_, at) in self._last.items() if now - at > RECENT_SECONDS]:
                del self._last[pk]
            found = {pk: (0, 0, batch) for pk, (batch, _) in self._last.items()}
            for pk, (interactive, batch) in self._counts.items():
                last = self._last.get(pk, (False, 0.0))[0]
                found[pk] = (interactive, batch, last)
            return found

    def demand(self) -> Counts | None:
        """Every process's counts (standalone: this one's), or None when not known."""
        if self._url is None:
            return self.own() if requests_in_progress.serves_here() else None
        link = redislink.link(self._url)
        if not link.answers():
            return None
        try:
            raw = self._redis().hgetall(_KEY)
        except redislink.errors() as exc:
            link.failed(exc)
            return None
        link.answered()
        now = time.time()
        found: dict[int, tuple[int, int, bool]] = {}
        latest: dict[int, float] = {}  # whose last end is the latest, among processes
        stale = []
        for field, value in raw.items():
            rows = _rows(value, now)
            if rows is None:
                stale.append(field)  # left by a process that is gone, or not one we wrote
                continue
            for key, interactive, batch, last, ended in rows:
                had = found.get(key, (0, 0, False))
                if ended >= latest.get(key, -1.0):
                    latest[key] = ended
                    had = (had[0], had[1], last)
                found[key] = (had[0] + interactive, had[1] + batch, had[2])
        if stale:
            self._forget(stale)
        return found

    def _forget(self, fields: list[Any]) -> None:
        try:
            self._redis().hdel(_KEY, *fields)
        except redislink.errors() as exc:  # the next read tries again
            logger.debug("could not remove stale request classes: %s", exc)

    # -- server mode: publishing ----------------------------------------------------------

    def close(self) -> None:
        """Stop publishing, and take this process's counts out of Redis at once (rather
        than after :data:`STALE_SECONDS`)."""
        self._closed.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join(timeout=RENEW_SECONDS + 1)
        if self._url is not None:
            try:
                self._redis().hdel(_KEY, self._process)
            except redislink.errors() as exc:  # it goes stale, and its readers remove it
                logger.debug("could not remove this process's request classes: %s", exc)

    def _publish_soon(self) -> None:
        if self._url is None or self._closed.is_set():
            return
        self._changed.set()
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._publish_loop, name="capyctl-classes", daemon=True
                    )
                    self._thread.start()

    def _publish_loop(self) -> None:
        published_any = False
        while not self._closed.is_set():
            changed = self._changed.wait(RENEW_SECONDS)
            if changed and not self._closed.is_set():
                time.sleep(PUBLISH_SECONDS)  # what changes meanwhile goes in the same write
            if self._closed.is_set():
                return
            self._changed.clear()
            counts = self.own()
            if not counts and not published_any:
                continue
            try:
                self._write(counts)
                published_any = bool(counts)
            except Exception as exc:  # the next change or second tries again
                logger.debug("could not publish the request classes: %s", exc)
                self._changed.set()
                time.sleep(RENEW_SECONDS)

    def _write(self, counts: Counts) -> None:
        client = self._redis()
        if not counts:
            client.hdel(_KEY, self._process)
            return
        with self._lock:  # when each last end was, on the wall clock (processes compare them)
            ago = {pk: time.monotonic() - at for pk, (_, at) in self._last.items()}
        now = time.time()
        rows = {str(pk): [i, b, last, now - ago.get(pk, RECENT_SECONDS)]
                for pk, (i, b, last) in counts.items()}  # fmt: skip
        body = json.dumps({"at": now, "counts": rows})
        pipe = client.pipeline()
        pipe.hset(_KEY, self._process, body)
        pipe.expire(_KEY, 3600)
        pipe.execute()


def _rows(value: Any, now: float) -> list[tuple[int, int, int, bool, float]] | None:
    """One process's published counts: ``(deployment, interactive, batch, last was
    batch, when it ended)`` each; None when stale or not of the shape this version writes
    (a field is taken whole or not at all)."""
    try:
        data = json.loads(value)
        if now - float(data["at"]) >= STALE_SECONDS:
            return None
        rows = []
        for pk, (interactive, batch, last, ended) in data["counts"].items():
            counts = (int(pk), int(interactive), int(batch), bool(last), float(ended))
            if counts[1] < 0 or counts[2] < 0:
                return None
            rows.append(counts)
        return rows
    except Exception:  # any other shape: another version's, or garbled
        return None


_classes: Classes | None = None
_classes_lock = threading.Lock()


def classes() -> Classes:
    global _classes  # noqa: PLW0603 - one a process, made on first use
    if _classes is not None:  # every /v1 request asks: no lock once it is made
        return _classes
    with _classes_lock:
        if _classes is None:
            _classes = Classes(settings.REDIS_URL or None)
        return _classes


def begin(deployment_id: int, batch: bool) -> None:
    """A request of that class waits for the deployment, or is in flight on it."""
    classes().begin(deployment_id, batch)


def end(deployment_id: int, batch: bool) -> None:
    """The request counted by :func:`begin` is over (answered, refused or gone)."""
    classes().end(deployment_id, batch)


def demand() -> Counts | None:
    """Per deployment, the interactive and batch requests that wait for it or are in
    flight on it, in every process; None when that cannot be known now."""
    return classes().demand()


def batch_only(
    counts: Counts | None,
    deployment_id: int,
    *,
    busy: bool = False,
    group: frozenset[int] = frozenset(),
) -> bool:
    """Whether only batch requests want the deployment: some do, no interactive one; for
    a ``busy`` model none of whose requests is counted now (its last ended a moment ago),
    whether that last one was batch. ``group``: the other replicas of its model, whose
    requests count too (a replica brought up for them has none of its own)."""
    if counts is None:
        return False
    interactive = batch = 0
    for pk in (deployment_id, *group):
        found = counts.get(pk, (0, 0, False))
        interactive, batch = interactive + found[0], batch + found[1]
    if interactive or batch:
        return interactive == 0
    return busy and counts.get(deployment_id, (0, 0, False))[2]
