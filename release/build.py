"""Build CapyCTL's distributions into one folder (``make dist``):

- ``capyctl``: everything (server, standalone, CLI, host agent, the pages' templates and
  assets), from the top of the tree (``pyproject.toml``, ``setup.py``);
- ``capyctl-host``: the host agent alone, without the server's packages, from
  ``release/host/pyproject.toml`` and copies of ``capyctl/`` and ``hostagent/``.

Each is a wheel and an sdist, built with ``python -m build`` (an isolated build
environment, as pip builds them)."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST = ROOT / "release" / "host"
# How `build` shows the backend's warnings ("WARNING Package 'x' is absent ..."), and how
# Python does ("SetuptoolsDeprecationWarning: ...").
WARNING = re.compile(r"(?m)^\s*WARNING .*$|\b\w+Warning\b")
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


def build(source: Path, out: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(source)],
        check=False,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"building {source} failed (exit {done.returncode})")
    warned = sorted(set(WARNING.findall(done.stdout + done.stderr)))
    if warned:  # setuptools' warnings are about the package's configuration: fix, not ship
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"building {source}: {len(warned)} warning(s), shown above; fix them")


def build_host(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="capyctl-host-") as work:
        tree = Path(work)
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(HOST / name, tree / name)
        for package in ("capyctl", "hostagent"):
            shutil.copytree(ROOT / package, tree / package, ignore=_SKIP)
        build(tree, out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "dist"), help="where to put them (dist/)")
    out = Path(parser.parse_args().out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    build(ROOT, out)
    build_host(out)
    for built in sorted(out.iterdir()):
        sys.stdout.write(f"{built.name}  {built.stat().st_size / 1024:.0f} KiB\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
