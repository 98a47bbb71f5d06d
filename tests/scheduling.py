"""Helpers for scheduler tests: a simulated host driven in this process, and shorthands."""

import sys

from capyctl.deployments.models import Deployment
from capyctl.deployments.services import DeploymentSpec, add_deployment
from capyctl.engines.services import add_engine
from capyctl.ledger.models import LedgerEntry
from capyctl.scheduler.drivers import LocalHostDriver, set_local_driver
from capyctl.scheduler.host_states import ensure_local_host
from hostagent.probe import SimulatedProbe

GIB = 1024**3
MIB = 1024**2
SIM = f"{sys.executable} -m hostagent.sim"
SIM_ENV = {"CAPYCTL_SIM_WEIGHTS_BYTES": "8GiB", "CAPYCTL_SIM_RESIDUAL_BYTES": "512MiB"}


def make_host(tmp_path, settings, spec):
    """A local host with simulated GPUs ``spec``; a model just ready, or busy, may be
    parked at once (no residency, no turns: tests of turns set their own)."""
    settings.CAPYCTL = {**settings.CAPYCTL, "GPU_RESERVE_BYTES": 0, "MIN_READY_SECONDS": 0,
                        "MAX_TURN_SECONDS": 0}  # fmt: skip
    probe = SimulatedProbe(spec, tmp_path / "sim")
    driver = LocalHostDriver(probe, tmp_path / "logs")
    set_local_driver(driver)
    ensure_local_host(probe.inventory())
    return driver


def deployment(name, engine="sim-vllm", gib=16, source=None, **extra):
    """A deployment of a simulated engine; its default source is a one-word name the
    engine resolves itself (nothing to download or check: an OWNER/NAME would be fetched
    from the Hub)."""
    return add_deployment(
        DeploymentSpec(
            name=name,
            engine=engine,
            source=source or name,
            gpu_memory_bytes=gib * GIB,
            **extra,
        )
    )


def vllm_engine():
    return add_engine("sim-vllm", kind="vllm", command=f"{SIM} vllm", env=SIM_ENV)


def entries(name):
    return {e.pool: (e.status, e.bytes) for e in LedgerEntry.objects.filter(deployment__name=name)}


def state(name):
    d = Deployment.objects.get(name=name)
    return d.observed_state, d.parked_mode
