"""Which replica of a deployment a ``/v1`` request goes to.

A request goes to the ready replica with the fewest requests in flight, unless it has an
affinity key (:func:`affinity_key`: its ``x-session-id`` header, its body's ``user``, or
the start of its prompt). Requests with the same key go to the same replica, as long as
that replica's load stays within a bound: consistent hashing with bounded loads
(Mirrokni, Thorup and Zadimoghaddam, 2018), as KubeAI's PrefixHash load balancer does
(``internal/loadbalancer/balance_chwbl.go``). Each replica has :data:`POINTS_PER_REPLICA`
points on a ring of 64-bit hashes; a key's hash is looked up on the ring, which is walked
clockwise to the first replica whose load, with this request, stays within
``ceil(load_factor * (total in flight + 1) / replicas)``. Such a replica always exists
for a ``load_factor`` of 1 or more, so no replica is ever sent past the bound; a replica
added or removed moves only about ``1 / replicas`` of the keys.

Plain Python, nothing from Django or the rest of CapyCTL: the gateway calls it on its hot
path, once a request (about 5 µs at 64 replicas, the key read included:
``bench/routing.py``). The caller counts the request in flight on the replica chosen
before it picks again.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections import OrderedDict
from collections.abc import Collection, Hashable, Mapping
from typing import Any, Generic, TypeVar

ReplicaId = TypeVar("ReplicaId", bound=Hashable)

POINTS_PER_REPLICA = 256  # KubeAI's default replication
LOAD_FACTOR = 1.25  # KubeAI's default, 125 % of the mean
SESSION_CHARS = 256  # of an ``x-session-id`` header or a body's ``user``
PREFIX_CHARS = 100  # of a prompt, as KubeAI's default prefixCharLength
_PARTS_READ = 32  # a list content's parts read for its text, at most
_RINGS_KEPT = 64  # rings kept, one per set of replicas seen lately

_turn = itertools.count()  # the tie-breaker of picks without a key


def affinity_key(headers: Any, body: Any) -> str | None:
    """What ties a request to a replica, or None.

    ``headers``: the request's headers, names lower-cased (``bytes`` or ``str``, both
    looked up); ``body``: its parsed JSON body. In order: the ``x-session-id`` header
    (its first :data:`SESSION_CHARS` characters), the body's ``user`` when it is a string
    (as many), the first :data:`PREFIX_CHARS` characters of the prompt: a chat's first
    user message (its string content, or the text of its parts), a completion's
    ``prompt`` (a string, or a list whose first item is one), a response's ``input`` (the
    same as a chat's messages, or a string). Anything else, empty values included, gives
    None. Never raises, whatever the types; its work and its answer are bounded."""
    session = _session_header(headers)
    if session:
        return "s:" + session
    if not isinstance(body, dict):
        return None
    user = body.get("user")
    if isinstance(user, str) and user:
        return "u:" + user[:SESSION_CHARS]
    prefix = _prompt_prefix(body)
    return "p:" + prefix if prefix else None


def _session_header(headers: Any) -> str | None:
    if not isinstance(headers, Mapping):
        return None
    value = headers.get(b"x-session-id")
    if value is None:
        value = headers.get("x-session-id")
    if isinstance(value, bytes | bytearray):
        value = bytes(value[:SESSION_CHARS]).decode("latin-1")
    if not isinstance(value, str):
        return None
    return value[:SESSION_CHARS].strip() or None


def _prompt_prefix(body: dict[Any, Any]) -> str:
    messages = body.get("messages")
    if isinstance(messages, list):
        return _first_user_text(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt[:PREFIX_CHARS]
    given = body.get("input")  # the Responses API
    if isinstance(given, str):
        return given[:PREFIX_CHARS]
    if isinstance(given, list):
        return _first_user_text(given)
    return ""


def _first_user_text(messages: list[Any]) -> str:
    """The first :data:`PREFIX_CHARS` characters of the first user message's text."""
    for message in messages:
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content[:PREFIX_CHARS]
        if not isinstance(content, list):
            return ""
        text = ""
        for part in itertools.islice(content, _PARTS_READ):
            piece = part.get("text") if isinstance(part, dict) else None
            if isinstance(piece, str):
                text += piece[: PREFIX_CHARS - len(text)]
                if len(text) >= PREFIX_CHARS:
                    break
        return text
    return ""


def _hash(data: str) -> int:
    # surrogatepass: JSON may carry lone surrogates ("\ud800"), which plain UTF-8 refuses
    digest = hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Ring(Generic[ReplicaId]):
    """The hash ring of one set of replicas: :data:`POINTS_PER_REPLICA` points each, at
    the hash of ``f"{replica_id}\\x1f{i}"`` (the separator keeps ids from colliding by
    concatenation: replica "1" point 11 is not replica "11" point 1). ``points`` sorted,
    ``owners[i]`` the replica of ``points[i]``."""

    __slots__ = ("ids", "owners", "points")

    def __init__(self, ids: Collection[ReplicaId], per_replica: int = POINTS_PER_REPLICA):
        self.ids = frozenset(ids)
        placed = sorted(
            ((_hash(f"{replica}\x1f{i}"), str(replica), replica)
             for replica in self.ids for i in range(per_replica)),
            key=lambda point: point[:2],
        )  # fmt: skip
        self.points = [point for point, _, _ in placed]
        self.owners: list[ReplicaId] = [replica for _, _, replica in placed]

    def start(self, key: str) -> int:
        """The index of the first point at or after the key's hash (clockwise)."""
        index = bisect.bisect_left(self.points, _hash(key))
        return 0 if index == len(self.points) else index


_rings: dict[frozenset[Any], Ring[Any]] = {}


def ring_of(ids: Collection[ReplicaId]) -> Ring[ReplicaId]:
    """The ring of these replicas, built once while the set stays the same (the last
    :data:`_RINGS_KEPT` sets seen are kept)."""
    frozen = frozenset(ids)
    ring = _rings.get(frozen)
    if ring is None:
        ring = Ring(frozen)
        if len(_rings) >= _RINGS_KEPT:
            oldest = next(iter(_rings), None)  # the first built of those kept
            if oldest is not None:
                _rings.pop(oldest, None)
        _rings[frozen] = ring
    return ring


def choose(
    replicas: Mapping[ReplicaId, int],
    key: str | None = None,
    *,
    load_factor: float = LOAD_FACTOR,
    exclude: Collection[ReplicaId] = (),
) -> ReplicaId:
    """The replica for a request: ``replicas`` maps each ready replica to its requests in
    flight; ``key`` is the request's :func:`affinity_key`.

    Without a key: the fewest in flight; among those tied, each in turn (a counter
    rotates over them), so picks made on the same counts still spread. With a key: the
    first replica clockwise from the key's hash on the ring whose load with this request,
    ``in_flight + 1``, is at most ``ceil(load_factor * (total + 1) / n)``. ``exclude``:
    replicas not to use (the one a failed try went to, when the gateway tries again); the
    bound is then over the others. Raises ValueError when no replica is left to choose,
    or when ``load_factor`` is below 1."""
    if not load_factor >= 1:  # NaN too
        raise ValueError(f"load_factor must be 1 or more, not {load_factor!r}")
    candidates = _candidates(replicas, exclude)
    if key is None or len(candidates) == 1:
        return _least_loaded(candidates)
    # With at least one load under the mean, n * cap >= total + 1 makes one load < cap.
    cap = math.ceil(load_factor * (sum(candidates.values()) + 1) / len(candidates))
    ring = ring_of(replicas.keys())
    owners = ring.owners
    size = len(owners)
    index = ring.start(key)
    get = candidates.get
    for _ in range(size):
        owner = owners[index]
        load = get(owner)
        if load is not None and load < cap:
            return owner
        index += 1
        if index == size:
            index = 0
    return _least_loaded(candidates)  # not reached while load_factor >= 1


HOMES_KEPT = 4096  # affinity keys whose replica a model remembers (least recently seen go)


class Homes(Generic[ReplicaId]):
    """Which replica each affinity key of one model lives on, so that a prefix stays in
    one engine's cache and the keys are spread evenly over the replicas.

    Consistent hashing alone (:func:`choose`) leaves the keys where their hashes fall: with
    a few hot prefixes, one replica may get twice its share of them and another none, and
    its caches thrash. Here a key seen for the first time goes to the first replica
    clockwise from its hash that has no more than its share of the keys,
    ``ceil((keys + 1) / replicas)`` (bounded loads over keys, as the original method
    bounds items per bin), and stays there: each later request with that key goes to its
    replica while that replica's requests in flight stay under ``max(busy,
    ceil(LOAD_FACTOR * (total + 1) / n))``; past it, that one request takes the
    bounded-load ring walk (:func:`choose`) and the key keeps its home. A key whose
    replica left routing is placed again. Every API process keeps its own homes; as they
    all walk the same ring, they mostly agree.

    Plain Python; the gateway calls :meth:`choose` once a request."""

    __slots__ = ("_count", "_home", "_kept")

    def __init__(self, kept: int = HOMES_KEPT) -> None:
        self._home: OrderedDict[str, ReplicaId] = OrderedDict()
        self._count: dict[ReplicaId, int] = {}
        self._kept = kept

    def choose(
        self,
        loads: Mapping[ReplicaId, int],
        key: str | None = None,
        *,
        busy: int = 0,
        exclude: Collection[ReplicaId] = (),
    ) -> ReplicaId:
        """The replica for a request (``loads``: each ready replica's requests in flight;
        ``busy``: in flight below which a replica takes its keys' requests whatever the
        others carry; ``exclude``: replicas not to use)."""
        candidates = _candidates(loads, exclude)
        if key is None or len(candidates) == 1:
            return _least_loaded(candidates)
        home = self._home.get(key)
        if home is None or home not in candidates:
            home = self._place(key, candidates)
        else:
            self._home.move_to_end(key)
        cap = max(busy, math.ceil(LOAD_FACTOR * (sum(candidates.values()) + 1) / len(candidates)))
        if candidates[home] < cap:
            return home
        return choose(candidates, key, exclude=())  # past the bound: this request only

    def home_of(self, key: str) -> ReplicaId | None:
        return self._home.get(key)

    def _place(self, key: str, candidates: Mapping[ReplicaId, int]) -> ReplicaId:
        count = self._count
        old = self._home.pop(key, None)
        if old is not None:
            count[old] -= 1
        if len(self._home) >= self._kept:  # room for it first: the least recently seen goes
            _, gone = self._home.popitem(last=False)
            count[gone] -= 1
        share = math.ceil((sum(count.get(r, 0) for r in candidates) + 1) / len(candidates))
        ring = ring_of(candidates.keys())
        owners, size = ring.owners, len(ring.owners)
        index = ring.start(key)
        chosen = owners[index]
        for _ in range(size):
            owner = owners[index]
            if owner in candidates and count.get(owner, 0) < share:
                chosen = owner
                break
            index = index + 1 if index + 1 < size else 0
        self._home[key] = chosen
        count[chosen] = count.get(chosen, 0) + 1
        return chosen


def _candidates(
    loads: Mapping[ReplicaId, int], exclude: Collection[ReplicaId]
) -> Mapping[ReplicaId, int]:
    """``loads`` without the replicas of ``exclude``; ValueError when none is left."""
    candidates = loads
    if exclude:
        candidates = {r: load for r, load in loads.items() if r not in exclude}
    if not candidates:
        raise ValueError("no replica to choose from")
    return candidates


def _least_loaded(candidates: Mapping[ReplicaId, int]) -> ReplicaId:
    low = min(candidates.values())
    tied = [r for r, load in candidates.items() if load == low]
    return tied[0] if len(tied) == 1 else tied[next(_turn) % len(tied)]
