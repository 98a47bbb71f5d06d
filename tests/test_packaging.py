"""What the distributions declare matches what the code imports: every third-party module
``capyctl`` and ``hostagent`` import is declared in ``pyproject.toml`` (the host agent's in
``release/host/pyproject.toml``), nothing declared goes unused, and ``requirements.txt``
pins each declared distribution inside its range. The wheels themselves are built and
installed by ``tests/test_install.py``."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from django.conf import settings
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
OURS = {"capyctl", "hostagent"}
DOTTED = re.compile(r"[a-z_][a-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

# Distributions the code needs without an import statement of theirs, and why.
USED_BY_NAME = {
    "psycopg": "Django's PostgreSQL backend loads it for a postgres:// database URL",
}


def _requirements(pyproject: Path) -> dict[str, Requirement]:
    declared = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {canonicalize_name(r.name): r for r in map(Requirement, declared)}


def _imports(*roots: str) -> tuple[set[str], set[str], set[str]]:
    """Top-level third-party modules used under ``roots``: (imported, optional, named),
    where optional ones are imported inside ``try: ... except ImportError`` and named ones
    are strings a library loads by name (``"channels_redis.core.RedisChannelLayer"``,
    ``http="httptools"``), which count as a use but, being words, demand no declaration."""
    installed = set(importlib.metadata.packages_distributions())
    required: set[str] = set()
    optional: set[str] = set()
    named: set[str] = set()
    for root in roots:
        for path in (ROOT / root).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            guarded: set[int] = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Try) and any(
                    isinstance(h.type, ast.Name)
                    and h.type.id in {"ImportError", "ModuleNotFoundError"}
                    for h in node.handlers
                ):
                    guarded.update(id(inner) for inner in ast.walk(node))
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    top = node.value.partition(".")[0]
                    if DOTTED.fullmatch(node.value) and top in installed - OURS:
                        named.add(top)
                    continue
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.partition(".")[0]
                    if top in sys.stdlib_module_names or top in OURS:
                        continue
                    (optional if id(node) in guarded else required).add(top)
    return required, optional, named


def _distributions(modules: set[str]) -> dict[str, set[str]]:
    """module -> the distributions (canonical names) that provide it, as installed here."""
    provided = importlib.metadata.packages_distributions()
    return {m: {canonicalize_name(d) for d in provided.get(m, [])} for m in modules}


def test_every_module_the_code_imports_is_declared_and_nothing_declared_is_unused() -> None:
    declared = _requirements(ROOT / "pyproject.toml")
    required, optional, named = _imports("capyctl", "hostagent")
    apps = {app.partition(".")[0] for app in settings.INSTALLED_APPS} - {"django"} - OURS
    needed = required | apps
    providers = _distributions(needed | optional | named | {"django"})
    undeclared = {
        m: sorted(d) for m, d in providers.items() if m in needed and not d & set(declared)
    }
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    used = set().union(*providers.values()) | set(USED_BY_NAME)
    assert not set(declared) - used, f"declared but never imported: {set(declared) - used}"


def test_requirements_txt_pins_every_declared_distribution_inside_its_range() -> None:
    declared = _requirements(ROOT / "pyproject.toml")
    pins: dict[str, str] = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        text = line.partition("#")[0].strip()
        if text:
            pinned = Requirement(text)
            (spec,) = pinned.specifier
            assert spec.operator == "==", f"requirements.txt pins exactly: {text}"
            pins[canonicalize_name(pinned.name)] = spec.version
    assert set(pins) == set(declared), (
        f"pinned, not declared: {set(pins) - set(declared)}; "
        f"declared, not pinned: {set(declared) - set(pins)}"
    )
    outside = {n: (v, str(declared[n].specifier)) for n, v in pins.items()
               if not declared[n].specifier.contains(v, prereleases=True)}  # fmt: skip
    assert not outside, f"pins outside pyproject.toml's ranges: {outside}"


def test_the_host_install_declares_what_the_agent_imports_in_the_full_installs_ranges() -> None:
    host = _requirements(ROOT / "release" / "host" / "pyproject.toml")
    full = _requirements(ROOT / "pyproject.toml")
    required, optional, named = _imports("hostagent")
    needed = set().union(*_distributions(required | optional).values())
    used = needed | set().union(*_distributions(named).values())
    assert needed <= set(host) <= used, (
        f"the agent imports, not declared: {needed - set(host)}; "
        f"declared, never used: {set(host) - used}"
    )
    assert not {"django", "celery", "channels", "djangorestframework"} & set(host)
    for name, requirement in host.items():
        assert name in full, f"{name}: in capyctl-host, not in capyctl"
        assert requirement.specifier == full[name].specifier, f"{name}: ranges differ"


def test_the_host_agent_starts_with_none_of_the_servers_packages(tmp_path: Path) -> None:
    """`capyctl start host` in an interpreter where Django, Celery, Channels, DRF and Redis
    cannot be imported: it gets as far as checking its arguments, and says what is wrong."""
    blocked = ["django", "celery", "channels", "rest_framework", "redis", "kombu",
               "daphne", "psycopg", "matplotlib", "drf_spectacular"]  # fmt: skip
    script = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "from capyctl.cli import run\n"
        "sys.exit(run(['start', 'host', '--listen', 'nowhere:x', '--data-dir', sys.argv[1]]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "agent")],
        check=False, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "capyctl: error: invalid --listen 'nowhere:x': the port must be a number from 1 to 65535"
    ]
    other = subprocess.run(
        [sys.executable, "-c", script.replace("'start', 'host', '--listen', 'nowhere:x', "
                                              "'--data-dir', sys.argv[1]", "'status'"), "-"],
        check=False, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert other.returncode == 2
    assert "runs only the host agent" in other.stderr
