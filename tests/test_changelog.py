"""The version and the changelog: one version everywhere, and no fragment that towncrier
would leave out of a release."""

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import capyctl

ROOT = Path(__file__).resolve().parent.parent
FRAGMENTS = ROOT / "changelog.d"
# Files towncrier itself skips in the fragments folder.
NOT_FRAGMENTS = {".gitignore", ".gitkeep", ".keep", "readme", "readme.md"}


def towncrier_config() -> dict[str, Any]:
    towncrier: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
        "towncrier"
    ]
    return towncrier


def newest_release() -> str:
    text = (ROOT / "CHANGELOG.md").read_text()
    _, marker, releases = text.partition("<!-- towncrier release notes start -->")
    assert marker, "CHANGELOG.md lost the line towncrier writes releases under"
    heading = re.search(r"^## (\S+) \(\d{4}-\d{2}-\d{2}\)$", releases, re.MULTILINE)
    assert heading is not None, "CHANGELOG.md has no release heading"
    return heading[1]


def test_capyctl_version_is_the_newest_release_and_the_package_version():
    done = subprocess.run(
        [sys.executable, "-m", "capyctl", "--version"], capture_output=True, text=True, check=False
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == f"capyctl {newest_release()}\n"
    assert capyctl.__version__ == newest_release()
    # pyproject.toml writes no version of its own: it reads capyctl.__version__ ...
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "capyctl.__version__"}
    # ... and the installed package says the same (stale after a bump until reinstalled).
    assert importlib.metadata.version("capyctl") == capyctl.__version__


def test_capyctl_version_sets_up_no_django():
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "capyctl", "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    assert "capyctl.cli.parser" in imported  # the listing is the one we think it is
    assert [name for name in imported if name.split(".")[0] == "django"] == []


def test_every_fragment_has_a_known_type():
    types = {t["directory"] for t in towncrier_config()["type"]}
    assert {"added", "changed", "fixed", "security"} <= types
    assert towncrier_config()["directory"] == FRAGMENTS.name
    fragments = [p for p in FRAGMENTS.iterdir() if p.name.lower() not in NOT_FRAGMENTS]
    for fragment in fragments:
        named = re.fullmatch(r"(?P<issue>[^.]+)\.(?P<type>[a-z]+)(\.\d+)?\.md", fragment.name)
        assert named is not None, f"{fragment.name}: name it NAME.TYPE.md (towncrier create)"
        assert named["type"] in types, (
            f"{fragment.name}: unknown type {named['type']!r}; use one of {sorted(types)}"
        )
        assert fragment.read_text().strip(), f"{fragment.name} is empty"


def test_the_next_release_shows_every_fragment():
    """towncrier itself renders each fragment into the next release's entry."""
    done = subprocess.run(
        [str(Path(sys.executable).parent / "towncrier"), "build", "--draft", "--version", "9.9.9"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("## 9.9.9 (")
    rendered = " ".join(done.stdout.split())
    for fragment in FRAGMENTS.glob("*.md"):
        if fragment.name.lower() not in NOT_FRAGMENTS:
            assert " ".join(fragment.read_text().split()) in rendered, fragment.name
