"""Simulated GPUs: devices described by ``CAPYCTL_SIM_GPUS`` and what processes hold on them.

Simulated engines record their allocations in a state directory, one JSON file per
process (``<pid>.json``: ``{"gpu": {"0": bytes}, "host_bytes": bytes}``), written
atomically. The simulated probe reads those files, so its per-process figures are real
readings of the simulation, not constants; files of dead processes are ignored.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hostagent.units import SizeError, parse_size

SIM_GPUS_ENV = "CAPYCTL_SIM_GPUS"
SIM_STATE_ENV = "CAPYCTL_SIM_STATE_DIR"
# What the simulated probe lets CapyCTL see of the engines' processes, as NVML does in the
# places it runs: ``own`` (their pids, as on a bare host), ``foreign`` (pids of another pid
# namespace: a container without the host's pids), ``empty`` (no process listed) or
# ``unknown`` (processes listed with no figure: NVML_VALUE_NOT_AVAILABLE).
SIM_PIDS_ENV = "CAPYCTL_SIM_PIDS"
SIM_PIDS = ("own", "foreign", "empty", "unknown")

_PART_RE = re.compile(r"^(?:(?P<count>\d+)x)?(?P<size>\d[0-9.]*\s?[A-Za-z]*)$")


@dataclass(frozen=True)
class SimSpec:
    """Simulated devices: ``unified`` (one pool shared with RAM) or discrete GPU sizes;
    ``pids``: how the probe lists the processes that use them (:data:`SIM_PIDS`)."""

    unified: bool
    sizes: list[int]
    pids: str = "own"


def parse_sim_gpus(value: str, pids: str = "own") -> SimSpec:
    """Parse ``24GiB``, ``2x80GiB``, ``24GiB,48GiB`` or ``unified:128GiB``; ``pids`` is
    one of :data:`SIM_PIDS`.

    Raises ``ValueError`` with a message that names the bad part.
    """
    if pids not in SIM_PIDS:
        raise ValueError(f"{pids!r} is not one of: {', '.join(SIM_PIDS)}")
    text = value.strip()
    if text.startswith("unified:"):
        try:
            size = parse_size(text.removeprefix("unified:"))
        except SizeError as exc:
            raise ValueError(str(exc)) from None
        return SimSpec(unified=True, sizes=[size], pids=pids)
    sizes: list[int] = []
    for part in text.split(","):
        match = _PART_RE.match(part.strip())
        if match is None:
            raise ValueError(
                f"{part.strip()!r} is not a GPU list entry (examples: 24GiB, 2x80GiB, "
                "unified:128GiB)"
            )
        count = int(match["count"] or 1)
        if not 1 <= count <= 64:
            raise ValueError(f"{part.strip()!r}: a GPU count must lie between 1 and 64")
        try:
            size = parse_size(match["size"])
        except SizeError as exc:
            raise ValueError(str(exc)) from None
        sizes.extend([size] * count)
    return SimSpec(unified=False, sizes=sizes, pids=pids)


def default_state_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"capyctl-sim-{os.getuid()}"


def state_dir_from_env() -> Path:
    given = os.environ.get(SIM_STATE_ENV)
    return Path(given) if given else default_state_dir()


@dataclass
class ProcessAllocation:
    pid: int
    gpu: dict[int, int]
    host_bytes: int


def write_allocation(state_dir: Path, pid: int, gpu: dict[int, int], host_bytes: int) -> None:
    """Record what process ``pid`` holds now (atomically: readers never see half a file)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    payload = json.dumps({"gpu": {str(k): v for k, v in gpu.items()}, "host_bytes": host_bytes})
    tmp = state_dir / f".{pid}.json.tmp"
    tmp.write_text(payload)
    tmp.replace(state_dir / f"{pid}.json")


def clear_allocation(state_dir: Path, pid: int) -> None:
    (state_dir / f"{pid}.json").unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    import psutil  # noqa: PLC0415 - the settings read this module's parser, and need no psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def read_allocations(state_dir: Path) -> list[ProcessAllocation]:
    """Allocations of live processes; a dead process's file counts for nothing."""
    found: list[ProcessAllocation] = []
    if not state_dir.is_dir():
        return found
    for path in state_dir.glob("*.json"):
        try:
            pid = int(path.stem)
            data = json.loads(path.read_text())
        except (ValueError, OSError):
            continue
        if not _alive(pid):
            continue
        gpu = {int(k): int(v) for k, v in (data.get("gpu") or {}).items()}
        found.append(ProcessAllocation(pid=pid, gpu=gpu, host_bytes=int(data.get("host_bytes", 0))))
    return found
