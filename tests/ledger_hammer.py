"""Random ledger writers for the concurrency test, importable before Django is set up
(spawned processes import this module first, then configure Django)."""

from __future__ import annotations

import contextlib
import os
import random

GIB = 1024**3


def hammer(host_id: int, deployment_ids: list[int], seed: int, steps: int) -> int:
    """Random admissions and releases; returns how many over-commits it saw (must be 0)."""
    from django.db import connection

    from capyctl.ledger.services import (
        InsufficientMemoryError,
        admit,
        host_lock,
        overcommitted,
        release,
    )

    rng = random.Random(seed)  # noqa: S311 - a seeded, repeatable test schedule
    seen = 0
    try:
        for _ in range(steps):
            deployment = rng.choice(deployment_ids)
            pools = rng.sample(["gpu0", "gpu1", "ram"], rng.randint(1, 2))
            with host_lock(host_id) as host:
                if rng.random() < 0.65:
                    need = {pool: rng.randint(1, 14) * GIB for pool in pools}
                    with contextlib.suppress(InsufficientMemoryError):
                        admit(host, deployment, need)
                else:
                    release(host, deployment, pools)
                seen += len(overcommitted(host))
    finally:
        connection.close()
    return seen


def process_main(
    database_url: str, data_dir: str, host_id: int, ids: list[int], *, seed: int, steps: int
) -> int:
    """Entry point of a spawned process: its own Django, the same database."""
    os.environ["CAPYCTL_DATABASE_URL"] = database_url
    os.environ["CAPYCTL_DATA_DIR"] = data_dir
    os.environ["CAPYCTL_GPU_RESERVE"] = "0"
    os.environ["CAPYCTL_RAM_RESERVE"] = "0"
    os.environ["DJANGO_SETTINGS_MODULE"] = "capyctl.settings"
    import django

    django.setup()
    return hammer(host_id, ids, seed, steps)
