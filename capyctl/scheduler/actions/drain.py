"""Draining: a ready model stops taking requests and its requests in flight finish."""

from __future__ import annotations

from capyctl.deployments.models import Deployment
from capyctl.scheduler import requests_in_progress, transitions
from capyctl.scheduler.errors import SchedulerError


def drain(deployment: Deployment, doing: str) -> bool:
    """READY -> DRAINING, then wait for its requests in flight; on a timeout it goes back
    to READY and this raises (CapyCTL never cuts a request short to make room). False: it
    was not ready when asked (another caller drains, parks or stops it), and nothing was
    closed. ``doing``: what the drain is for (``parking``, ``stopping``), for the reason."""
    if not transitions.draining(deployment.pk):
        return False
    drain_seconds = deployment.setting("drain_timeout_seconds")
    try:
        if requests_in_progress.wait_drained(deployment.pk, drain_seconds):
            return True
    except requests_in_progress.CountsUnknown as exc:  # never taken for zero: it stays ready
        message = (
            f"gave up {doing} {deployment.name}: its requests in flight cannot be counted ({exc})"
        )
        transitions.drain_abandoned(deployment, message, kind="deployment.drain_abandoned")
        raise requests_in_progress.CountsUnknown(message) from exc
    left = requests_in_progress.count_or_none(deployment.pk)
    message = (
        f"gave up {doing} {deployment.name}: "
        + (f"{left} request(s)" if left is not None else "request(s)")
        + f" still in flight after {drain_seconds}s"
    )
    transitions.drain_abandoned(deployment, message)
    raise SchedulerError(message)
