"""Boundaries of DESIGN §3 that the code must keep."""

import pkgutil
import subprocess
import sys

import hostagent


def test_hostagent_imports_no_django_and_nothing_from_capyctl():
    modules = [
        m.name
        for m in pkgutil.walk_packages(hostagent.__path__, "hostagent.")
        if not m.name.endswith("__main__")  # importing it would run the program
    ]
    assert "hostagent.kinds.vllm" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "banned = ('django', 'capyctl', 'rest_framework', 'channels')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in banned)\n"
        "print(','.join(bad))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""
