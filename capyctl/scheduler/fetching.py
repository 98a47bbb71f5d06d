"""Getting a deployment's weights onto its host before its engine starts.

A local path is checked on the host; an ``hf://`` or ``http(s)://`` source (and a bare
Hugging Face id for vLLM, SGLang and TensorFold, as ``hf://``) is fetched into the host's
cache while the deployment is ``downloading``. Progress (bytes, rate, ETA) is
kept on the deployment (``download``, and a line in ``state_reason``) and a few events
mark the way. Every start of the same source on a host joins the one fetch under way.
"""

from __future__ import annotations

import time

from django.utils import timezone

from capyctl.deployments.models import Deployment, ObservedState
from capyctl.hosts.models import Host
from capyctl.scheduler import transitions
from capyctl.scheduler.drivers import driver_for
from hostagent.sources import FetchStatus, classify, engine_source
from hostagent.units import format_size

POLL_SECONDS = 0.5


class SourceFailedError(Exception):
    """The source could not be found or fetched; the message is for people."""


def describe(status: FetchStatus) -> str:
    """``1.2 GiB of 4.0 GiB, 35.0 MiB/s, about 1m20s left``."""
    done = format_size(status.done_bytes)
    text = f"{done} of {format_size(status.total_bytes)}" if status.total_bytes else done
    if status.rate_bytes_per_second > 0:
        text += f", {format_size(int(status.rate_bytes_per_second))}/s"
    if status.eta_seconds is not None and status.state == "running":
        text += f", about {_duration(status.eta_seconds)} left"
    return text


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def fetch_source(deployment: Deployment, host: Host, actor: str) -> str | None:
    """The path of the deployment's weights on ``host``, fetched there if need be.

    Returns ``None`` when the deployment left ``downloading`` meanwhile (stopped by a
    person): the fetch itself goes on into the cache, where the next start finds it.
    Raises :class:`SourceFailedError` when the source is missing or the fetch failed.
    """
    # A bare Hugging Face id for an engine that would download it itself is fetched here,
    # as hf://OWNER/NAME, unless the engine's options leave it to the engine.
    source = engine_source(
        deployment.source, deployment.engine.kind, deployment.engine.options or {}
    )
    kind = classify(source)
    if kind == "engine":
        return deployment.source  # a name the engine resolves: nothing to check or fetch
    driver = driver_for(host)
    status = driver.fetch_start(source)  # a local path is settled at once
    remote = kind in ("hf", "http")
    started = time.monotonic()
    announced = False
    quarter = 0
    if remote:
        # Into `downloading` only from a settled state; a start that finds it downloading
        # already joins that fetch (the same job on the host) and waits with it.
        transitions.downloading(deployment, host)
    while True:
        if status.state != "running":
            break
        if remote:
            state = (
                Deployment.objects.filter(pk=deployment.pk)
                .values_list("observed_state", flat=True)
                .first()
            )
            if state != ObservedState.DOWNLOADING:
                return None
            announced = announced or _announce(deployment, host, status, actor)
            _save_progress(deployment, status)
            if status.total_bytes:
                reached = int(4 * status.done_bytes / status.total_bytes)
                if 0 < reached < 4 and reached > quarter:
                    quarter = reached
                    transitions.record(
                        deployment, "deployment.download_progress",
                        f"{deployment.name}: downloaded {describe(status)}", actor=actor,
                    )  # fmt: skip
        time.sleep(POLL_SECONDS)
        found = driver.fetch_status(source)
        if found is None:  # the host forgot it (an agent restarted): ask again
            found = driver.fetch_start(source)
        status = found
    if status.state == "failed":
        raise SourceFailedError(f"{status.error} (on host {host.name})")
    if remote:
        _save_progress(deployment, status)
        if status.downloaded:
            announced = announced or _announce(deployment, host, status, actor)
            seconds = max(time.monotonic() - started, 0.001)
            transitions.record(
                deployment, "deployment.downloaded",
                f"downloaded {deployment.source}: {format_size(status.done_bytes)} in "
                f"{_duration(seconds)} ({format_size(int(status.done_bytes / seconds))}/s)",
                started=started, actor=actor,
            )  # fmt: skip
    Deployment.objects.filter(pk=deployment.pk).update(source_bytes=status.size_bytes)
    return status.path


def _announce(deployment: Deployment, host: Host, status: FetchStatus, actor: str) -> bool:
    """The ``downloading`` event, once a fetch turns out to need a download."""
    if not status.downloaded:
        return False
    size = f" ({format_size(status.total_bytes)})" if status.total_bytes else ""
    transitions.record(
        deployment, "deployment.downloading",
        f"downloading {deployment.source} to {host.name}{size}", actor=actor,
    )  # fmt: skip
    return True


def _save_progress(deployment: Deployment, status: FetchStatus) -> None:
    data = {**status.as_dict(), "updated_at": timezone.now().isoformat()}
    transitions.download_progress(
        deployment, data, f"downloading {deployment.source}: {describe(status)}"
    )
