"""Asking for start, stop, park or wake: one path for the CLI, the REST API and the admin.

The intent is saved first (the desired state for start and stop, and an operation row),
then carried out by the process that owns the engines; the asker may wait on the row.
"""

from __future__ import annotations

import time

from capyctl.deployments.models import Adapter, Deployment
from capyctl.errors import UserError
from capyctl.scheduler import transitions
from capyctl.scheduler.executor import server_alive, submit
from capyctl.scheduler.models import Operation
from hostagent.kinds import get_kind

ACTIONS = ("start", "stop", "park", "wake", "restart")
PARK_MODES = ("ram", "deep")
RESTART_MODES = ("rolling",)


def request_action(
    deployment: Deployment, action: str, *, mode: str = "", actor: str = ""
) -> Operation | None:
    """Save the intent and hand it to the server. Returns the operation, or ``None`` when
    no server runs and only the desired state of a start or stop was saved (it takes effect
    when one runs). Raises :class:`UserError` for a park or wake nobody could carry out."""
    if action not in ACTIONS:
        raise UserError(f"unknown action {action!r}; expected one of {', '.join(ACTIONS)}")
    modes = {"park": PARK_MODES, "restart": RESTART_MODES}.get(action, ())
    if mode and mode not in modes:
        raise UserError(
            f"mode {mode!r} is not allowed here: a park takes ram or deep, a restart rolling",
            field="mode",
        )
    alive = server_alive()  # first: an intent nobody can be told changes nothing
    if action in ("start", "stop"):
        desired = "running" if action == "start" else "stopped"
        transitions.desired(deployment.pk, desired)  # and its replicas
    if not alive:
        if action in ("start", "stop"):
            return None
        raise UserError(
            f"cannot {action} {deployment.name}: no CapyCTL server is running on this "
            "data dir (start one with 'capyctl start standalone' or 'capyctl start server')"
        )
    op = Operation.objects.create(deployment=deployment, action=action, mode=mode, actor=actor)
    submit(op)
    return op


def default_timeout(deployment: Deployment) -> float:
    """How long an asker waits by default: a start plus a drain."""
    return float(
        deployment.setting("start_timeout_seconds") + deployment.setting("drain_timeout_seconds")
    )


def wait_for(op: Operation, timeout: float) -> Operation:
    """Poll the operation until it is done or failed, or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        op.refresh_from_db()
        if op.status in (Operation.Status.DONE, Operation.Status.FAILED):
            return op
        if time.monotonic() >= deadline:
            return op
        time.sleep(0.1)


def seconds_taken(op: Operation) -> float:
    return (op.finished_at - op.created_at).total_seconds() if op.finished_at else 0.0


def restart_to_take(adapter: Adapter, *, actor: str = "") -> str:
    """Where the base's engine takes adapters at launch only (llama-server) and runs now,
    ask for its restart, which waits for its requests in flight to end; what happens, in
    one line ("" where the adapter loads when asked for)."""
    base, engine = adapter.base, adapter.base.engine
    caps = get_kind(engine.kind).capabilities(engine.options, engine.features())
    if caps.runtime_adapters or base.observed_state in ("stopped", "failed"):
        return ""
    try:
        request_action(base, "restart", actor=actor)
    except UserError:  # no server runs: its next start takes it
        return (
            f"{base.name} takes it at its next start ({engine.kind} takes its adapters at launch)"
        )
    return (
        f"{base.name} restarts to take it once its requests in flight have ended "
        f"({engine.kind} takes its adapters at launch)"
    )
