"""Registering and removing engines. Every entry point (CLI, REST, admin) calls these."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from capyctl.engines.models import Engine
from capyctl.errors import NotFoundError, UserError
from capyctl.events.services import record_event
from capyctl.hosts.services import get_host
from capyctl.validation import validate_name
from hostagent.kinds import KindError, UnknownKindError, get_kind


def get_engine(name: str) -> Engine:
    try:
        return Engine.objects.select_related("host").get(name=name)
    except Engine.DoesNotExist:
        raise NotFoundError(f"no engine named {name!r}", field="engine") from None


def check_engine(name: str, kind: str, command: str, options: dict[str, Any] | None = None) -> None:
    """Validate an engine's name, kind and command; raise :class:`UserError` if wrong."""
    validate_name(name, what="engine name")
    try:
        engine_kind = get_kind(kind)
    except UnknownKindError as exc:
        raise UserError(str(exc), field="kind") from None
    try:
        engine_kind.check_command(command)
    except KindError as exc:
        raise UserError(str(exc), field="command") from None
    try:
        engine_kind.check_options(options or {})
    except KindError as exc:
        raise UserError(str(exc), field="options") from None


@transaction.atomic
def add_engine(
    name: str,
    *,
    kind: str,
    command: str,
    host: str | None = None,
    env: dict[str, str] | None = None,
    options: dict[str, Any] | None = None,
    actor: str = "",
) -> Engine:
    """Register an installed engine program. CapyCTL never installs engines."""
    check_engine(name, kind, command, options)
    if env is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise UserError("engine env must map names to string values", field="env")
    host_row = get_host(host) if host else None
    if Engine.objects.filter(name=name).exists():
        raise UserError(f"an engine named {name!r} already exists", field="name")
    engine = Engine.objects.create(
        name=name, kind=kind, command=command, host=host_row, env=env or {}, options=options or {}
    )
    record_event(
        "engine.added",
        f"engine {name} ({kind}) registered: {command}",
        subject=name,
        actor=actor,
        host_id=host_row.pk if host_row else None,
    )
    return engine


@transaction.atomic
def remove_engine(name: str, *, actor: str = "") -> None:
    engine = get_engine(name)
    users = list(engine.deployments.values_list("name", flat=True))
    if users:
        raise UserError(
            f"engine {name!r} is used by deployments: {', '.join(users)}; remove them first",
            field="name",
        )
    engine.delete()
    record_event("engine.removed", f"engine {name} removed", subject=name, actor=actor)
