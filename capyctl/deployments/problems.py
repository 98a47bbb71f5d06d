"""What keeps a deployment from ever starting, as far as this machine can tell (reads only).

A deployment larger than every known host's largest GPU pool (or needing more GPUs than any
host has) cannot start until the hosts change; an engine whose program is not on the host
that runs it cannot start anything. ``deployment add`` and ``engine add`` warn of these
(the setup is still stored: the GPU or the program may come later), and ``status`` shows
them on the model's row. The figures are the scheduler's own (its estimates and pools), so
what is said here is what a start would answer.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from capyctl.deployments.models import Deployment
from capyctl.engines.models import Engine
from capyctl.hosts.models import Host
from capyctl.ledger.pools import device_total, pool_usage
from capyctl.scheduler import estimates
from hostagent.kinds import KindError, get_kind
from hostagent.units import format_size


def _gpu_capacities(host: Host) -> list[int]:
    return [u.capacity_bytes for u in pool_usage(host) if u.pool != "ram"]


def never_fits(deployment: Deployment) -> str | None:
    """Why ``deployment`` fits on none of the hosts it may run on, even with all else
    stopped; None when it fits on one, or when a host it may run on has not reported its
    GPUs yet (nothing can be said of it)."""
    if deployment.gpus == 0:
        return None
    hosts = [deployment.host] if deployment.host is not None else list(Host.objects.all())
    if not hosts or any(not h.inventory for h in hosts):
        return None
    most_gpus, largest, claim_shown = 0, 0, 0
    for host in hosts:
        capacities = _gpu_capacities(host)
        claim = estimates.claim_per_gpu(deployment, device_total(host))
        if sum(1 for c in capacities if c >= claim) >= deployment.gpus:
            return None
        most_gpus = max(most_gpus, len(capacities))
        largest = max(largest, *capacities, 0)
        claim_shown = max(claim_shown, claim)
    if most_gpus < deployment.gpus:
        most = f"the most one host has is {most_gpus}"
        return f"{deployment.name} needs {deployment.gpus} GPUs; {most}"
    return (
        f"{deployment.name} needs {format_size(claim_shown)} per GPU; the largest GPU pool "
        f"holds {format_size(largest)}"
    )


def missing_program(engine: Engine, *, relative: bool = True) -> str | None:
    """The program of ``engine``'s command where it runs on this machine (no host, or the
    local one) and is not found here; None when it is found, or runs elsewhere. Without
    ``relative``, a command given as a relative path is not looked at (it is relative to
    where CapyCTL was started, which this process may not share)."""
    if engine.host is not None and not engine.host.is_local:
        return None
    try:
        argv = get_kind(engine.kind).check_command(engine.command)
    except KindError:
        return None
    program = argv[0] if argv else ""
    if not program or (not relative and os.sep in program and not Path(program).is_absolute()):
        return None
    return None if shutil.which(program) else program


def _runs_here(deployment: Deployment) -> bool:
    """Whether the deployment can only run on this machine's host."""
    if deployment.host is not None:
        return deployment.host.is_local
    return not Host.objects.filter(is_local=False).exists()


def program_problem(deployment: Deployment, *, relative: bool = True) -> str | None:
    engine = deployment.engine
    program = missing_program(engine, relative=relative) if _runs_here(deployment) else None
    if program is None:
        return None
    return f"engine {engine.name}'s program {program} is not found on this host"


def problem(deployment: Deployment, *, relative: bool = False) -> str | None:
    """What keeps a stopped or failed deployment from starting, as far as can be told here."""
    if deployment.observed_state not in ("stopped", "failed"):
        return None
    return never_fits(deployment) or program_problem(deployment, relative=relative)
