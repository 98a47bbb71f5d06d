"""Requests served, refused and queued: each one's outcome as the gateway would answer it,
and the number waiting over time."""

from __future__ import annotations

from functools import partial

from capyctl.whatif.ledger import Ledger
from capyctl.whatif.model import Request
from capyctl.whatif.state import _Model


class Serving(Ledger):
    """What happens to a request once its model is ready, or once its wait ends."""

    _queued: int

    def _serve(self, model: _Model, request: Request, index: int) -> None:
        if model.host is not None:
            self._fire(model.host.changed)
        model.in_flight += 1
        model.last_used = self.now
        served = self.out.requests[index]
        served.status, served.waited = 200, self.now - request.at
        service = request.service if request.service is not None else model.spec.timings.service
        served.ended = self.now + service
        self._at(served.ended, partial(self._done, model))

    def _done(self, model: _Model) -> None:
        if model.host is not None:
            self._fire(model.host.changed)
        model.in_flight -= 1
        model.last_used = model.last_end = self.now
        if model.in_flight == 0:
            self._fire(model.drained)

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
