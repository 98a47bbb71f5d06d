"""Fixtures for the whole checkout, and the pages' console blocks collected as tests.

``README.md`` and ``docs/*.md`` are collected by Sybil; ``tests/docshell.py`` runs their
console blocks and says how a page shows commands and output."""

from sybil import Sybil

from tests.docshell import ConsoleBlocks, page_teardown
from tests.redis_db import redis_run, redis_url  # noqa: F401 - fixtures for every test and page

pytest_collect_file = Sybil(
    parsers=[ConsoleBlocks()],
    patterns=["README.md", "docs/*.md"],
    fixtures=["redis_run"],
    teardown=page_teardown,
).pytest()
