"""A watcher thread that proves it watched: it counts its looks and keeps its own failure,
so a check that found nothing wrong cannot hide a watcher that died or never looked."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from django.db import connection


class Watcher:
    """Call ``look`` over and over until stopped, once more after the stop (the state the
    work ended in), collecting what each look reports."""

    def __init__(self, look: Callable[[], Iterable[str]]) -> None:
        self.found: list[str] = []
        self.looks = 0
        self.failure: BaseException | None = None
        self._look = look
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watcher", daemon=True)

    def _run(self) -> None:
        try:
            while True:
                last = self._stop.is_set()
                self.found.extend(self._look())
                self.looks += 1
                if last:
                    break
        except BaseException as exc:  # kept for the test to report; nothing else sees it
            self.failure = exc
        finally:
            connection.close()  # the thread's own database connection, if a look opened one

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def verify(self, min_looks: int) -> list[str]:
        """After the watch: it ended, it did not fail, it looked often enough; what it found."""
        assert not self._thread.is_alive(), "the watcher is still in a look"
        assert self.failure is None, f"the watcher died: {self.failure!r}"
        assert self.looks >= min_looks, f"the watcher looked {self.looks} times (< {min_looks})"
        return self.found
