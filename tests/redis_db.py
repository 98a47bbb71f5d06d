"""A Redis database of this test run's own, so two runs on one machine (a developer's and
CI's) never see each other's keys.

A run claims the first database, counting down from 15 (0 is everyone's default, and people
pick low numbers), that is empty or that a test run which died left behind. The claim is a
key set only if absent, so two runs cannot take the same database, and it expires, so a run
that died frees it. Tests delete the keys of their own database; nothing flushes a database
another run may use.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

REDIS_SERVER = "redis://127.0.0.1:6379"
CLAIM = "capyctl-test:claim"  # this run's id; expires if the run dies without cleaning up
USED = "capyctl-test:used"  # stays: the database holds only test keys, a later run may reuse it
CLAIM_SECONDS = 3600


@dataclass
class RedisDb:
    url: str
    client: redis.Redis
    run_id: str

    def clean(self, *, everything: bool = False) -> None:
        """Delete the keys tests left; renew the claim (still ours, or the run stops)."""
        if self.client.get(CLAIM) != self.run_id.encode():
            pytest.fail(f"this run lost its claim on {self.url}: another run may be using it")
        marks = set() if everything else {CLAIM.encode(), USED.encode()}
        keys = [key for key in self.client.scan_iter(count=1000) if key not in marks]
        if keys:
            self.client.delete(*keys)
        if not everything:
            self.client.expire(CLAIM, CLAIM_SECONDS)


def claim_database(run_id: str) -> RedisDb:
    for number in range(15, 0, -1):
        url = f"{REDIS_SERVER}/{number}"
        client = redis.Redis.from_url(url)
        if not client.set(CLAIM, run_id, nx=True, ex=CLAIM_SECONDS):
            continue  # another run holds it
        if client.dbsize() == 1 or client.exists(USED):
            client.set(USED, "1")
            db = RedisDb(url, client, run_id)
            db.clean()
            return db
        client.delete(CLAIM)  # somebody's own data: not ours to touch
        client.close()
    pytest.fail(f"no Redis database at {REDIS_SERVER} is free for this test run (15 to 1)")


@pytest.fixture(scope="session")
def redis_run() -> Iterator[RedisDb]:
    db = claim_database(uuid.uuid4().hex)
    try:
        yield db
    finally:
        db.clean(everything=True)
        db.client.close()


@pytest.fixture
def redis_url(redis_run: RedisDb) -> Iterator[str]:
    """The URL of this run's Redis database, with no keys but the claim before and after."""
    redis_run.clean()
    yield redis_run.url
    redis_run.clean()
