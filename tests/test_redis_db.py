"""Each test run has a Redis database of its own: two runs on one machine never meet, and a
database holding anybody else's keys is never touched."""

import redis

from capyctl.scheduler.requests_in_progress import RedisInFlight
from tests.redis_db import RedisDb, claim_database
from tests.test_requests_in_progress import in_use


def test_two_runs_get_databases_of_their_own(redis_run: RedisDb, redis_url: str) -> None:
    other = claim_database("another-run")
    try:
        assert other.url != redis_url
        theirs, ours = RedisInFlight(in_use(other.url)), RedisInFlight(in_use(redis_url))
        theirs.begin(7)  # the other run's request in flight
        assert ours.count(7) == 0
        redis_run.clean()
        assert theirs.count(7) == 1  # cleaning ours leaves theirs alone
    finally:
        for tracker in (theirs, ours):
            tracker.stop()
        other.clean(everything=True)


def test_a_database_holding_other_keys_is_never_claimed(redis_run: RedisDb) -> None:
    free = claim_database("probe-run")
    free.clean(everything=True)  # now empty and unclaimed: the first one a run would take
    someone = redis.Redis.from_url(free.url)
    someone.set("someone:else", "theirs")
    try:
        taken = claim_database("next-run")
        try:
            assert taken.url != free.url
            assert someone.get("someone:else") == b"theirs"
        finally:
            taken.clean(everything=True)
    finally:
        someone.delete("someone:else")
