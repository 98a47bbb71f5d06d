"""Who waits for room on each host, and since when: what turns are decided on.

A start or wake that cannot be placed now, only because of something that passes (a busy
model in its turn, one inside its ``min_ready_seconds``, a switch under way), notes here
that it waits (:func:`note`, under the host lock, with the GPU pools it waits for) and is
forgotten when its wait ends (:func:`done`). The policy reads the other contenders of the
host (:func:`contenders`): a model that has waited longer for the same GPUs goes first,
and a busy model keeps its memory until the contender's wait (:func:`waited`) passes its
``max_turn_seconds``.

Standalone keeps the waits in this process. Server mode shares them through Redis (the
workers that try are several processes): one hash per host, ``deployment -> since`` and
``deployment -> seen``; a wait not seen for :data:`SEEN_SECONDS` (its worker died) counts
no more. When Redis does not answer, each process goes on with what it knows itself.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from django.conf import settings

from capyctl.scheduler import redislink
from capyctl.scheduler.errors import NoCapacityError
from capyctl.scheduler.policy import Contender, NoCapacity

logger = logging.getLogger("capyctl.scheduler")

# A wait is noted again at every try (every quarter second); one not noted for this long
# was left by a process that is gone.
SEEN_SECONDS = 3.0
_KEY = "capyctl:turns:{}"  # a hash per host: deployment id -> {"since", "seen", ...}


@dataclass
class Wait:
    deployment_id: int
    name: str
    host_id: int
    since: float  # wall clock: comparable between processes
    seen: float
    priority: int = 0
    pools: tuple[str, ...] = ()
    claim_bytes: int = 0  # what it needs on each of its GPUs; 0 = not known

    def contender(self, now: float) -> Contender:
        return Contender(self.deployment_id, self.name, max(now - self.since, 0.0),
                         self.priority, self.pools, self.claim_bytes)  # fmt: skip


class Registry(Protocol):
    def note(self, wait: Wait) -> float: ...

    def done(self, deployment_id: int) -> None: ...

    def contenders(self, host_id: int) -> list[Contender]: ...

    def waited(self, deployment_id: int) -> float: ...


class LocalRegistry:
    """The waits of this process (standalone, and server mode's fallback)."""

    def __init__(self) -> None:
        self._waits: dict[int, Wait] = {}
        self._lock = threading.Lock()

    def note(self, wait: Wait) -> float:
        """Note (or renew) a wait; returns when it began."""
        with self._lock:
            old = self._waits.get(wait.deployment_id)
            if old is not None and old.host_id == wait.host_id:
                wait.since = old.since
            self._waits[wait.deployment_id] = wait
            return wait.since

    def done(self, deployment_id: int) -> None:
        with self._lock:
            self._waits.pop(deployment_id, None)

    def contenders(self, host_id: int) -> list[Contender]:
        now = time.time()
        return [w.contender(now) for w in self.waits() if w.host_id == host_id]

    def waited(self, deployment_id: int) -> float:
        with self._lock:
            wait = self._waits.get(deployment_id)
        return max(time.time() - wait.since, 0.0) if wait is not None else 0.0

    def waits(self) -> list[Wait]:
        """Every wait this process knows of, renewed lately."""
        now = time.time()
        with self._lock:
            return [w for w in self._waits.values() if now - w.seen < SEEN_SECONDS]

    def adopt(self, deployment_id: int, since: float) -> None:
        """Its wait began earlier, in another process (a worker before this one)."""
        with self._lock:
            wait = self._waits.get(deployment_id)
            if wait is not None:
                wait.since = min(wait.since, since)


class RedisRegistry:
    """Waits shared by every process through Redis; each process also keeps its own, so
    a Redis that does not answer costs only what other processes' waits would have said."""

    def __init__(self, url: str) -> None:
        # Its calls run under the host lock: short timeouts, and none for a while once
        # Redis did not answer (this process's own waits meanwhile).
        self._redis = redislink.client(url)
        self._link = redislink.link(url)
        self._own = LocalRegistry()
        self._hosts: dict[int, int] = {}  # deployment -> host, for done()

    def _answers(self) -> bool:
        return self._link.answers()

    def _down(self, exc: BaseException) -> None:
        self._link.failed(exc)
        logger.debug("turns: Redis did not answer (%s); this process's waits only", exc)

    def note(self, wait: Wait) -> float:
        since = self._own.note(wait)
        self._hosts[wait.deployment_id] = wait.host_id
        if not self._answers():
            return since
        field = str(wait.deployment_id)
        try:
            key = _KEY.format(wait.host_id)
            raw = self._redis.hget(key, field)
            if raw:  # another process's wait for it (a worker before this one) counts
                since = min(since, float(json.loads(raw).get("since", since)))
                self._own.adopt(wait.deployment_id, since)
            value = {"name": wait.name, "since": since, "seen": time.time(),
                     "priority": wait.priority, "pools": list(wait.pools),
                     "claim": wait.claim_bytes}  # fmt: skip
            pipe = self._redis.pipeline()
            pipe.hset(key, field, json.dumps(value))
            pipe.expire(key, 3600)
            pipe.execute()
        except Exception as exc:
            self._down(exc)
        return since

    def done(self, deployment_id: int) -> None:
        self._own.done(deployment_id)
        host_id = self._hosts.pop(deployment_id, None)
        if host_id is None or not self._answers():
            return  # not seen again, it counts no more within SEEN_SECONDS
        try:
            self._redis.hdel(_KEY.format(host_id), str(deployment_id))
        except Exception as exc:
            self._down(exc)

    def contenders(self, host_id: int) -> list[Contender]:
        if not self._answers():
            return self._own.contenders(host_id)
        try:
            raw = self._redis.hgetall(_KEY.format(host_id))
        except Exception as exc:
            self._down(exc)
            return self._own.contenders(host_id)
        now = time.time()
        found = {c.deployment_id: c for c in self._own.contenders(host_id)}
        for field, value in raw.items():
            try:
                data: dict[str, Any] = json.loads(value)
                if now - float(data["seen"]) >= SEEN_SECONDS:
                    continue
                found.setdefault(int(field), Wait(int(field), str(data["name"]), host_id,
                                 float(data["since"]), float(data["seen"]),
                                 int(data.get("priority", 0)),
                                 tuple(data.get("pools") or ()),
                                 int(data.get("claim", 0))).contender(now))  # fmt: skip
            except (KeyError, TypeError, ValueError):
                continue  # not a wait this version wrote
        return list(found.values())

    def waited(self, deployment_id: int) -> float:
        return self._own.waited(deployment_id)


_registry: Registry | None = None
_registry_lock = threading.Lock()


def registry() -> Registry:
    global _registry  # noqa: PLW0603 - one registry a process, made on first use
    with _registry_lock:
        if _registry is None:
            url = settings.REDIS_URL
            _registry = RedisRegistry(url) if url else LocalRegistry()
        return _registry


def note(wait: Wait) -> float:
    return registry().note(wait)


def done(deployment_id: int) -> None:
    registry().done(deployment_id)


def contenders(host_id: int) -> list[Contender]:
    return registry().contenders(host_id)


def waited(deployment_id: int) -> float:
    return registry().waited(deployment_id)


def local_waits() -> list[Wait]:
    """The waits this process runs itself (standalone: all of them)."""
    found = registry()
    own = found if isinstance(found, LocalRegistry) else getattr(found, "_own", None)
    return own.waits() if isinstance(own, LocalRegistry) else []


def refused(
    deployment_id: int,
    name: str,
    result: NoCapacity,
    *,
    priority: int,
    host_id: int,
    pools: tuple[str, ...] = (),
    claim_bytes: int = 0,
) -> NoCapacityError:
    """The error for a plan on ``host_id`` that found no room; a wait for what passes is
    noted (the caller holds the host lock) with what it needs on each GPU
    (``claim_bytes``), so the contenders for these GPUs take turns in order of their waits
    and room freed for one is kept for it."""
    if not result.lasting:
        now = time.time()
        note(Wait(deployment_id, name, host_id, now, now, priority, result.pools or pools,
                  claim_bytes))  # fmt: skip
    return NoCapacityError(result.reason, result.blockers, lasting=result.lasting)
