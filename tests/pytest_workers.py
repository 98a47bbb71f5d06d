"""Each pytest-xdist worker gets a data directory of its own.

``capyctl.settings`` reads ``CAPYCTL_DATA_DIR`` once, when pytest-django loads the settings,
which happens before any conftest is imported; so this is a plugin that ``make test``
loads with ``-p tests.pytest_workers``, ahead of Django. Two workers sharing one data
directory would share the files written there and fail each other's tests.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if worker.startswith("gw") and worker[2:].isdigit():
    base = os.environ.get("CAPYCTL_DATA_DIR") or tempfile.mkdtemp(prefix="capyctl-tests-")
    own = Path(base) / worker
    own.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ["CAPYCTL_DATA_DIR"] = str(own)
