"""Requests served, refused and queued: each one's outcome as the gateway would answer it,
and the number waiting over time.

A request sent to a ready engine is counted in flight there at once (as the gateway counts
it); the engine works on ``max_concurrency`` of them at a time (no limit: 0), and the
others wait in it, in order. A request's wait is from its arrival to when its engine
begins on it: the wait for a start or wake, then the wait in its engine."""

from __future__ import annotations

import heapq
from functools import partial

from capyctl.whatif.ledger import Ledger
from capyctl.whatif.model import Request
from capyctl.whatif.state import _Group, _Model


class Serving(Ledger):
    """What happens to a request once its model is ready, or once its wait ends."""

    _queued: int

    def _serve(self, model: _Model, request: Request, index: int) -> None:
        """Send the request to ``model``'s engine, which is ready (one for an adapter the
        engine does not hold waits for its load first)."""
        if model.host is not None:
            self._fire(model.host.changed)
        model.in_flight += 1
        model.batch_in_flight += self._is_batch(request)
        model.last_used = self.now
        group = model.group
        if group is not None:
            group.version += 1
            self._began(group, model, request)
        if self._loads_first(model, request, index):
            return
        self._to_engine(model, request, index)

    def _to_engine(self, model: _Model, request: Request, index: int) -> None:
        """The engine has the request: it begins on it, or the request waits in it."""
        group = model.group
        limit = model.spec.max_concurrency
        if limit and model.running >= limit:  # it waits in the engine
            model.backlog.append((request, index))
            if group is not None:
                group.waiting += 1
                heapq.heappush(group.waiting_since, (request.at, index))
            return
        self._begin(model, request, index)

    def _begin(self, model: _Model, request: Request, index: int) -> None:
        """The engine begins on the request."""
        model.running += 1
        served = self.out.requests[index]
        served.status, served.waited, served.replica = 200, self.now - request.at, model.name
        service = request.service if request.service is not None else model.spec.timings.service
        served.ended = self.now + service
        self._at(served.ended, partial(self._done, model, request))

    def _done(self, model: _Model, request: Request) -> None:
        self._ended(model, request)
        if model.host is not None:
            self._fire(model.host.changed)
        model.in_flight -= 1
        model.batch_in_flight -= self._is_batch(request)
        model.last_batch = self._is_batch(request)
        model.running -= 1
        model.last_used = model.last_end = self.now
        group = model.group
        if group is not None:
            group.version += 1
        if model.backlog:
            request, index = model.backlog.popleft()
            if group is not None:
                group.waiting -= 1
            self._begin(model, request, index)
        if model.in_flight == 0:
            self._fire(model.drained)

    def _loads_first(self, model: _Model, request: Request, index: int) -> bool:
        """Whether the request, for an adapter ``model``'s engine does not hold yet, waits
        for its load (:class:`~capyctl.whatif.adapters.Adapters`)."""
        return False

    def _ended(self, model: _Model, request: Request) -> None:
        """The request's answer ended on ``model``'s engine."""

    def _began(self, group: _Group, replica: _Model, request: Request) -> None:
        """A request of a model of several replicas was sent to ``replica``: the gateway's
        scaling decision (:class:`~capyctl.whatif.replicas.Replicas`)."""

    def _demand(self, group: _Group, request: Request) -> tuple[int, float]:
        """The requests of ``group`` whose answer has not begun, ``request`` (just sent)
        with them, and how long the oldest has waited: the gateway's demand."""
        oldest = self.now - request.at
        if group.waiting:
            heap, requests = group.waiting_since, self.out.requests
            while requests[heap[0][1]].status == 200:  # begun since
                heapq.heappop(heap)
            oldest = max(oldest, self.now - heap[0][0])
        return group.waiting + 1, oldest

    def _answer(self, index: int, status: int, code: str | None, waited: float) -> None:
        served = self.out.requests[index]
        served.status, served.code, served.waited, served.ended = status, code, waited, self.now

    def _release_queue(self, model: _Model, code: str | None, status: int = 200) -> None:
        waiting, model.queue = model.queue, []
        self._queued -= len(waiting)
        for request, index in waiting:
            if code is None:
                self._serve(model, request, index)
            else:
                self._answer(index, status, code, self.now - request.at)
        self._note_waiting()

    def _note_waiting(self) -> None:
        waits = self.out.waiting
        if waits and waits[-1][0] == self.now:
            waits[-1] = (self.now, self._queued)
        else:
            waits.append((self.now, self._queued))
