"""docs/security.md names a test for each promise: each named test must exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_NAMED = re.compile(r"`(tests/test_\w+\.py)::(test_\w+)`")


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    return {node.name for node in tree.body if isinstance(node, functions)}


def test_every_test_the_security_page_names_exists():
    page = (ROOT / "docs" / "security.md").read_text()
    named = _NAMED.findall(page)
    assert len(named) >= 30, "the page should name a test for each promise"
    missing = [
        f"{file}::{name}"
        for file, name in named
        if not (ROOT / file).is_file() or name not in _tests_in(ROOT / file)
    ]
    assert not missing, f"docs/security.md names tests that do not exist: {missing}"
