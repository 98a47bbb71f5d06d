"""Each model's queue in this process: the requests waiting for it to be started, woken
or given room, by key, so that keys share a full queue fairly.

A queue holds at most its model's ``max_waiting`` requests. When it is full, a request
from a key that holds fewer places than another key takes one: the newest place of the key
that holds the most is given up (that request is answered 429 ``queue_full``), so one
key's flood never keeps another key's requests out. A key that already holds its share is
told the queue is full.
"""

from __future__ import annotations

import asyncio


class Place:
    """One waiting request's place; ``given_up`` is set when another key takes it."""

    __slots__ = ("given_up", "key")

    def __init__(self, key: int) -> None:
        self.key = key
        self.given_up: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class Queues:
    def __init__(self) -> None:
        self._places: dict[int, dict[int, list[Place]]] = {}  # model -> key -> places
        self._sizes: dict[int, int] = {}

    def count(self, model: int) -> int:
        return self._sizes.get(model, 0)

    def join(self, model: int, key: int, limit: int) -> Place | None:
        """A place in ``model``'s queue for a request of ``key``; None when the queue is
        full and ``key`` holds as many places as any other key (or one fewer)."""
        keys = self._places.setdefault(model, {})
        if self.count(model) >= limit:
            mine = len(keys.get(key, ()))
            most = max(keys, key=lambda k: len(keys[k]), default=None)
            if most is None or len(keys[most]) < mine + 2:
                return None
            taken = keys[most].pop()  # its newest: the oldest keep their places
            if not keys[most]:
                del keys[most]
            self._sizes[model] -= 1
            taken.given_up.set_result(None)
        place = Place(key)
        keys.setdefault(key, []).append(place)
        self._sizes[model] = self.count(model) + 1
        return place

    def leave(self, model: int, place: Place) -> None:
        """The request no longer waits (answered, failed, or gone); a place another key
        took is already given back."""
        keys = self._places.get(model, {})
        places = keys.get(place.key)
        if places is None or place not in places:
            return
        places.remove(place)
        if not places:
            del keys[place.key]
        self._sizes[model] -= 1
