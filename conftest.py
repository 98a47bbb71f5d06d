"""Fixtures for the whole checkout, and the pages' console blocks collected as tests.

``README.md`` and ``docs/*.md`` are collected by Sybil; ``tests/docshell.py`` runs their
console blocks and says how a page shows commands and output."""

from pathlib import Path

import pytest
from sybil import Sybil

from tests.docshell import ConsoleBlocks, page_teardown
from tests.own_servers import own_postgres, own_redis, small_disk  # noqa: F401 - fixtures
from tests.redis_db import redis_run, redis_url  # noqa: F401 - fixtures for every test and page

pytest_collect_file = Sybil(
    parsers=[ConsoleBlocks()],
    patterns=["README.md", "docs/*.md"],
    fixtures=["redis_run"],
    teardown=page_teardown,
).pytest()

# Modules whose behaviour depends on the database engine: row locks, conditional updates, the
# ledger's constraints, the scheduler's transitions, server-mode data, REST filtering and
# paging. `make test` runs the whole suite on SQLite, then these again on PostgreSQL
# (`pytest -m database`). Server mode's own tests always use PostgreSQL, so they run once.
DATABASE_MODULES = frozenset(
    {
        "test_api.py",
        "test_api_keys.py",
        "test_batched_writes.py",
        "test_cli_resources.py",
        "test_dashboard.py",
        "test_data_model.py",
        "test_engine_caps.py",
        "test_engine_versions.py",
        "test_host_revoke.py",
        "test_hosts_join.py",
        "test_intents.py",
        "test_key_cache_flood.py",
        "test_key_scope.py",
        "test_ledger.py",
        "test_measured_by_device.py",
        "test_offline_starts.py",
        "test_request_guards.py",
        "test_scheduler_faults.py",
        "test_scheduler_stress.py",
        "test_switching.py",
        "test_traces.py",
        "test_transitions.py",
        "test_unasked_parks.py",
        "test_upgrades.py",
        "test_user_ceilings.py",
    }
)


# The modules that take longest (`--durations`), slowest first: `make test` runs test files
# side by side (pytest-xdist, a file to a process), and one of these started last would
# keep the run going alone for minutes after the others finished.
SLOW_FIRST = (
    "test_whatif_agreement.py",
    "test_outages.py",
    "test_browser.py",
    "test_install.py",
    "test_server_mode.py",
    "test_stress_processes.py",
    "test_waiting_for_room.py",
    "test_live_replay.py",
    "test_turns.py",
    "test_gateway.py",
    "test_hosts_join.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.path)).name in DATABASE_MODULES:
            item.add_marker(pytest.mark.database)
    rank = {name: n for n, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.path)).name, len(SLOW_FIRST)))
