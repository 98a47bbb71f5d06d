"""How long choosing a replica takes, per /v1 request (capyctl.scheduler.routing).

The gateway will call it once a request, on its event loop, so it must stay small beside
the proxying itself: the target is at most 50 µs a request at 64 replicas. For each
number of replicas, a run of ``--picks`` requests, each one timed with all the gateway
would do: the key read from the request, the replica chosen, the request counted in flight
on it (``in_flight[r] += 1``) and, past ``--outstanding`` per replica, the oldest one
ended. Three ways:

least     no key: the replica with the fewest in flight (``choose(in_flight)``).
prompt    the key read from a realistic chat body (a system prompt of about 1 KB, then the
          user's message, one of 1000, drawn at random), then its replica as the gateway
          picks it (``Homes.choose``: the key's home while within the bound, a new key
          placed on the ring within its share of the keys).
session   the key read from an ``x-session-id`` header (one of 1000), then the same pick.

Each figure is the best of ``--rounds`` runs, in µs a request. ``kept``: the share of the
prompt-keyed requests that went to their key's home replica, the others having found it
past the bound. ``ring build``: building the ring of that many
replicas (256 points each), which happens once each time the set of replicas changes.

Run: .venv/bin/python bench/routing.py [--picks 20000] [--rounds 5] [--replicas 2 8 64]
"""

from __future__ import annotations

import argparse
import random
import time
from collections import deque
from collections.abc import Callable

from capyctl.scheduler.routing import Homes, Ring, affinity_key, choose

TARGET_US = 50.0
TARGET_REPLICAS = 64
KEYS = 1000

SYSTEM = (
    "You are a careful assistant for a support team. Answer in the customer's language, "
    "cite the knowledge-base article you used, never promise refunds, and keep answers "
    "under 200 words unless asked for more. "
) * 5


def chat_bodies(rng: random.Random) -> list[dict[str, object]]:
    words = ["order", "invoice", "refund", "shipping", "address", "password", "account",
             "delivery", "late", "broken"]  # fmt: skip
    bodies = []
    for i in range(KEYS):
        question = f"Ticket {i}: " + " ".join(
            rng.choice(words) for _ in range(rng.randint(40, 300))
        )
        bodies.append({
            "model": "llama-3.1-8b",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ],
            "max_tokens": 256,
            "temperature": 0.2,
            "stream": True,
        })  # fmt: skip
    return bodies


Request = tuple[dict[bytes, bytes], dict[str, object]]
Picker = Callable[[dict[str, int], Request], str]


def least() -> Picker:
    return lambda in_flight, request: choose(in_flight)


def keyed() -> Picker:
    """The gateway's pick, with a model's homes of its own (one per run)."""
    homes: Homes[str] = Homes()
    return lambda in_flight, request: homes.choose(in_flight, affinity_key(*request))


def run(
    make: Callable[[], Picker], replicas: int, requests: list[Request], outstanding: int
) -> float:
    """µs a request: the pick, its count in flight and the oldest request's end."""
    picker = make()
    in_flight = {f"replica-{i}": 0 for i in range(replicas)}
    open_: deque[str] = deque()
    limit = outstanding * replicas
    clock = time.perf_counter
    started = clock()
    for request in requests:
        chosen = picker(in_flight, request)
        in_flight[chosen] += 1
        open_.append(chosen)
        if len(open_) > limit:
            in_flight[open_.popleft()] -= 1
    return (clock() - started) / len(requests) * 1e6


def kept(replicas: int, requests: list[Request], outstanding: int) -> float:
    """The share of keyed requests that went to their key's home replica."""
    in_flight = {f"replica-{i}": 0 for i in range(replicas)}
    homes: Homes[str] = Homes()
    open_: deque[str] = deque()
    same = 0
    for request in requests:
        key = affinity_key(*request)
        chosen = homes.choose(in_flight, key)
        same += chosen == homes.home_of(str(key))
        in_flight[chosen] += 1
        open_.append(chosen)
        if len(open_) > outstanding * replicas:
            in_flight[open_.popleft()] -= 1
    return same / len(requests)


def ring_build_ms(replicas: int, rounds: int) -> float:
    ids = [f"replica-{i}" for i in range(replicas)]
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        Ring(ids)
        best = min(best, time.perf_counter() - started)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--picks", type=int, default=20_000, help="requests a run")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each; the best kept")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 8, 64])
    parser.add_argument("--outstanding", type=int, default=4,
                        help="requests in flight per replica before the oldest ends")  # fmt: skip
    args = parser.parse_args()

    rng = random.Random(1)
    bodies = chat_bodies(rng)
    prompt: list[Request] = [({}, rng.choice(bodies)) for _ in range(args.picks)]
    no_key: list[Request] = [({}, {}) for _ in range(args.picks)]
    sessions: list[Request] = [
        ({b"x-session-id": f"sess-{rng.randrange(KEYS):05d}".encode()}, rng.choice(bodies))
        for _ in range(args.picks)
    ]
    ways: list[tuple[Callable[[], Picker], list[Request]]] = [
        (least, no_key), (keyed, prompt), (keyed, sessions)
    ]  # fmt: skip

    print(f"µs a request, best of {args.rounds} runs of {args.picks} requests; "
          f"{args.outstanding} in flight per replica")  # fmt: skip
    print(f"{'replicas':>8}  {'least':>7}  {'prompt':>7}  {'session':>7}  {'kept':>5}  "
          f"{'ring build':>10}")  # fmt: skip
    slowest: dict[int, float] = {}
    for replicas in args.replicas:
        Ring([f"replica-{i}" for i in range(replicas)])  # warm the code, not the cache
        figures = [
            min(run(picker, replicas, requests, args.outstanding) for _ in range(args.rounds))
            for picker, requests in ways
        ]
        slowest[replicas] = max(figures)
        share = kept(replicas, prompt, args.outstanding)
        build = ring_build_ms(replicas, args.rounds)
        print(f"{replicas:>8}  {figures[0]:>7.1f}  {figures[1]:>7.1f}  {figures[2]:>7.1f}  "
              f"{share:>5.0%}  {build:>7.2f} ms")  # fmt: skip
    line = f"target: at most {TARGET_US:.0f} µs a request at {TARGET_REPLICAS} replicas"
    if TARGET_REPLICAS in slowest:
        met = "met" if slowest[TARGET_REPLICAS] <= TARGET_US else "MISSED"
        print(f"{line}: {slowest[TARGET_REPLICAS]:.1f} µs at worst, {met}")
    else:
        print(f"{line} (not measured in this run)")


if __name__ == "__main__":
    main()
