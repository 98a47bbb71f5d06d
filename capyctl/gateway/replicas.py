"""A model of several replicas: which one a ``/v1`` request goes to, and when one more is
brought up.

:meth:`Replicas.choose` picks among the model's ready replicas by the scheduler's routing
(:mod:`capyctl.scheduler.routing`: the fewest requests in flight, or the same replica for
the same session or prompt prefix, its keys spread evenly over the replicas, while its
load stays within a bound); with none ready,
the replica the request waits for: one coming up, else a parked one (waking is seconds),
else the first. It routes on this process's own requests in flight, plus, in server mode,
the other API processes' as Redis counts them (read in the background at most every
:data:`SHARED_EVERY_SECONDS` for a model that gets requests; while Redis is away, the
counts last read stand).

:meth:`Replicas.began` counts a request on its replica and asks the scheduler's scaling
decision (:func:`capyctl.scheduler.scaling.decide`, the same function the what-if
simulator and the scheduler's own pass run) whether to bring one more replica up: fewer
than the model's kept-up replicas are up, or a streamed request of this process has
waited longer than ``scale_up_wait_seconds`` for its answer to begin, or the ready
replicas carry more than ``target_concurrency`` on average. One comes up at a time (a
parked one woken first), in the background; the request itself is not held for it.
Parking replicas beyond the kept-up ones is the scheduler's pass
(:mod:`capyctl.scheduler.replica_scaling`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from capyctl.gateway.routing import Route
from capyctl.scheduler import gateway_api as scheduler
from capyctl.web import metrics

logger = logging.getLogger("capyctl.gateway")

_COMING_UP = frozenset(("starting", "waking", "downloading"))
SHARED_EVERY_SECONDS = 0.25


def serves(route: Route) -> bool:
    """Whether a replica takes requests now."""
    return (
        route.observed_state == "ready"
        and route.base_url is not None
        and route.host_state != "unreachable"
    )


def _state_of(route: Route) -> str:
    """What a replica's route says of its engine: a change is a restart or a wake."""
    return f"{route.observed_state}:{route.launch_key}"


def label(route: Route) -> bytes:
    """``x-capyctl-replica``: the host and GPUs of the replica that served a request."""
    return f"{route.host or '-'}/{','.join(str(g) for g in route.gpus)}".encode()


class Replicas:
    """This process's requests in flight on each replica, the replicas that failed a
    request lately, and the bring-ups under way."""

    def __init__(self, *, shared: bool | None = None) -> None:
        self.in_flight: dict[int, int] = {}
        # Server mode: the other processes' requests in flight on each replica, as last read.
        self.shared = scheduler.counts_shared() if shared is None else shared
        self.others: dict[int, int] = {}
        self._read_at: dict[int, float] = {}  # by the model's first replica
        self._reading: set[int] = set()
        self._homes: dict[int, Any] = {}  # by the model's first replica: its keys' homes
        self._bringing: dict[int, asyncio.Future[Any]] = {}  # by the model's first replica
        # Replicas whose engine failed a request, with the state it was routed in: out of
        # routing until the scheduler says another (ready again after a restart or wake).
        self._failed: dict[int, str] = {}
        # The requests of each model (by its first replica) not yet ended: when each
        # arrived (perf_counter) and its outcome, whose ``headers_at`` says its answer began.
        self._asked: dict[int, dict[int, tuple[float, Any]]] = {}

    def _serving(self, group: Route) -> dict[int, Route]:
        ready = {}
        for replica in group.replicas:
            failed = self._failed.get(replica.deployment_id)
            if failed is not None and failed != _state_of(replica):
                del self._failed[replica.deployment_id]  # it changed since: routed again
                failed = None
            if failed is None and serves(replica):
                ready[replica.deployment_id] = replica
        return ready

    def choose(self, group: Route, key: str | None) -> Route:
        """The replica of ``group`` (a model's first replica's route) for a request of
        affinity ``key`` (:func:`capyctl.scheduler.routing.affinity_key`)."""
        ready = self._serving(group)
        if ready:
            return self._pick(group, ready, key)
        for wanted in (_COMING_UP, {"ready"}, {"parked"}):
            for replica in group.replicas:
                if replica.observed_state in wanted and replica.desired_state == "running":
                    return replica
        return group

    def failed(self, group: Route, replica: Route, key: str | None) -> Route | None:
        """``replica`` failed a request before any byte of its answer went out: it is
        taken out of routing, and the request goes to another ready replica, if any (once:
        the caller does not ask again)."""
        self._failed[replica.deployment_id] = _state_of(replica)
        ready = self._serving(group)
        ready.pop(replica.deployment_id, None)
        return self._pick(group, ready, key) if ready else None

    def _pick(self, group: Route, ready: dict[int, Route], key: str | None) -> Route:
        """The routing's pick among ``ready``: the key's home replica while it is not
        past its bound, else the least loaded (:class:`capyctl.scheduler.routing.Homes`)."""
        homes = self._homes.get(group.deployment_id)
        if homes is None:
            homes = self._homes[group.deployment_id] = scheduler.KeyHomes()
        loads = {pk: self.in_flight.get(pk, 0) + self.others.get(pk, 0) for pk in ready}
        return ready[homes.choose(loads, key, busy=group.target_concurrency)]

    def _read_shared_soon(self, group: Route) -> None:
        """Read every process's counts of the model's replicas in the background, unless
        read lately or being read."""
        first = group.deployment_id
        if first in self._reading or (
            time.monotonic() - self._read_at.get(first, 0.0) < SHARED_EVERY_SECONDS
        ):
            return
        self._reading.add(first)
        asyncio.ensure_future(self.read_shared(group)).add_done_callback(_logged)

    async def read_shared(self, group: Route) -> None:
        """Note the other processes' requests in flight on each replica of ``group``."""
        first = group.deployment_id
        try:
            counts = await scheduler.shared_counts([r.deployment_id for r in group.replicas])
        finally:
            self._reading.discard(first)
            self._read_at[first] = time.monotonic()
        if counts is None:
            return  # Redis away: the counts last read stand
        for pk, total in counts.items():
            self.others[pk] = max(0, total - self.in_flight.get(pk, 0))

    def began(self, group: Route, replica: Route, started: float, outcome: Any) -> None:
        """A request (arrived at ``started``, its ``outcome`` noting when its answer began)
        was admitted on ``replica``; bring one more up if the scaling decision says so."""
        self.in_flight[replica.deployment_id] = self.in_flight.get(replica.deployment_id, 0) + 1
        metrics.count_replica(group.name, replica.name)
        first = group.deployment_id
        self._asked.setdefault(first, {})[id(outcome)] = (started, outcome)
        if self.shared:
            self._read_shared_soon(group)
        under_way = self._bringing.get(first)
        if under_way is not None and not under_way.done():
            return
        views = [
            scheduler.ReplicaView(
                id=r.deployment_id,
                # the replica just admitted is ready, however old the group's routes
                state="ready"
                if r.deployment_id == replica.deployment_id
                else r.observed_state
                if r.desired_state == "running"
                else "failed",
                in_flight=self.in_flight.get(r.deployment_id, 0),
                idle_seconds=0.0,
                up_since=0.0,
            )
            for r in group.replicas
        ]
        step = scheduler.scale_step(views, self._demand(first), group)
        if step is None:
            return
        self._bringing[first] = asyncio.ensure_future(
            scheduler.bring_up(step, group.name, group.max_queue_seconds)
        )
        self._bringing[first].add_done_callback(_logged)

    def _demand(self, first: int) -> tuple[int, float]:
        """This process's streamed requests of the model whose answer has not begun: how
        many, and how long the oldest has waited (seconds)."""
        now, waiting, oldest = time.perf_counter(), 0, 0.0
        for started, outcome in self._asked.get(first, {}).values():
            # A streamed request whose first byte has not come: it waits (in CapyCTL or
            # in the engine's queue). A non-streamed answer's head comes only once it is
            # all generated, so its wait cannot be told from its work: not counted.
            if outcome.stream and not outcome.headers_at:
                waiting += 1
                oldest = max(oldest, now - started)
        return waiting, oldest

    def ended(self, group: Route, replica_id: int, outcome: Any) -> None:
        left = self.in_flight.get(replica_id, 0) - 1
        if left > 0:
            self.in_flight[replica_id] = left
        else:
            self.in_flight.pop(replica_id, None)
        asked = self._asked.get(group.deployment_id)
        if asked is not None:
            asked.pop(id(outcome), None)
            if not asked:
                del self._asked[group.deployment_id]


def _logged(done: asyncio.Future[Any]) -> None:
    if not done.cancelled() and done.exception() is not None:
        logger.warning("a replica was not brought up: %s", done.exception())
