"""Registering and removing engines. Every entry point (CLI, REST, admin) calls these."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from capyctl.engines.models import Engine
from capyctl.errors import NotFoundError, UserError
from capyctl.events.models import Event
from capyctl.events.services import record_event
from capyctl.hosts.services import get_host
from capyctl.validation import validate_name
from hostagent.errors import EngineError
from hostagent.kinds import KindError, UnknownKindError, get_kind
from hostagent.versions import EngineFeatures, EngineProbeError, check_flags, detect


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


UNKNOWN_UNTIL_HOST = "version unknown until a host runs it"


def read_features(
    kind: str, command: str, env: dict[str, str], *, runs_here: bool
) -> EngineFeatures | None:
    """Ask the program its version (and flags) where its command runs in this process;
    else, or where it cannot run here, what says so. None: its kind is not asked."""
    probes = get_kind(kind).probes
    if probes is None:
        return None
    if not runs_here:
        return EngineFeatures(version="", note=UNKNOWN_UNTIL_HOST)
    try:
        return detect(get_kind(kind).check_command(command), probes, env=env)
    except EngineProbeError as exc:
        return EngineFeatures(version="", note=f"{UNKNOWN_UNTIL_HOST} ({exc})")


def check_engine_args(engine: Engine, args: list[str]) -> None:
    """Refuse deployment args naming a flag the engine's program (as last read) lacks."""
    features = engine.features()
    if features is None:
        return
    try:
        probes = get_kind(engine.kind).probes
        spelling = probes.spelling if probes is not None else None
        check_flags(f"engine {engine.name!r}", features, args, spelling)
    except EngineError as exc:
        raise UserError(str(exc), field="engine_args") from None


def _store_features(engine: Engine, features: EngineFeatures | None) -> list[str]:
    """Put ``features`` on the row (unsaved); the fields that changed."""
    if features is None:
        return []
    flags = sorted(features.flags) if features.flags is not None else None
    changed = []
    for field, value in (
        ("version", features.version[:100]),
        ("flags", flags),
        ("version_note", features.note[:300]),
    ):
        if getattr(engine, field) != value:
            setattr(engine, field, value)
            changed.append(field)
    engine.version_checked_at = timezone.now()
    return changed


def record_features(
    engine_id: int, features: dict[str, Any] | None, host_name: str, *, actor: str = "system"
) -> bool:
    """A host read the engine's program before its first launch there: remember what it
    said. True when that changed what was known."""
    if features is None:
        return False
    found = EngineFeatures.from_dict(features)
    if not found.version:  # the host could not read it either: keep what is known
        return False
    with transaction.atomic():
        engine = Engine.objects.select_for_update().filter(pk=engine_id).first()
        if engine is None:
            return False
        changed = _store_features(engine, found)
        engine.save(update_fields=["version", "flags", "version_note", "version_checked_at"])
    if {"version", "flags"} & set(changed):
        record_event(
            "engine.version",
            f"engine {engine.name}: host {host_name} runs {found.version}",
            subject=engine.name,
            actor=actor,
        )
    return bool(changed)


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
    """Register an installed engine program. CapyCTL never installs engines. Where its
    command runs here (no host, or the local one) its version is read first, outside the
    write transaction (it may take seconds)."""
    check_engine(name, kind, command, options)
    host_row = get_host(host) if host else None
    runs_here = host_row is None or host_row.is_local
    features = read_features(kind, command, dict(env or {}), runs_here=runs_here)
    return _add_engine(
        name,
        kind=kind,
        command=command,
        host=host,
        env=env,
        options=options,
        actor=actor,
        features=features,
    )


@transaction.atomic
def _add_engine(
    name: str,
    *,
    kind: str,
    command: str,
    host: str | None = None,
    env: dict[str, str] | None = None,
    options: dict[str, Any] | None = None,
    actor: str = "",
    features: EngineFeatures | None = None,
) -> Engine:
    check_engine(name, kind, command, options)
    if env is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise UserError("engine env must map names to string values", field="env")
    host_row = get_host(host) if host else None
    if Engine.objects.filter(name=name).exists():
        raise UserError(f"an engine named {name!r} already exists", field="name")
    engine = Engine(
        name=name, kind=kind, command=command, host=host_row, env=env or {}, options=options or {}
    )
    _store_features(engine, features)
    engine.save()
    shown = ""
    if features is not None:
        shown = f" (version {engine.version})" if engine.version else f" ({UNKNOWN_UNTIL_HOST})"
    record_event(
        "engine.added",
        f"engine {name} ({kind}) registered: {command}{shown}",
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


@transaction.atomic
def update_engine(
    name: str,
    *,
    new_name: str | None = None,
    kind: str | None = None,
    command: str | None = None,
    host: str | None = None,
    clear_host: bool = False,
    env: dict[str, str] | None = None,
    options: dict[str, Any] | None = None,
    actor: str = "",
) -> Engine:
    """Change an engine's settings; deployments pick them up at their next start. Its kind
    and host change only while none of its deployments runs."""
    engine = get_engine(name)
    Engine.objects.select_for_update().filter(pk=engine.pk).first()
    new_name = new_name if new_name is not None else engine.name
    kind = kind if kind is not None else engine.kind
    command = command if command is not None else engine.command
    options = options if options is not None else engine.options
    check_engine(new_name, kind, command, options)
    if env is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise UserError("engine env must map names to string values", field="env")
    host_row = None if clear_host else (get_host(host) if host else engine.host)
    if new_name != engine.name and Engine.objects.filter(name=new_name).exists():
        raise UserError(f"an engine named {new_name!r} already exists", field="name")
    moved = kind != engine.kind or host_row != engine.host
    live = list(
        engine.deployments.exclude(observed_state__in=("stopped", "failed")).values_list(
            "name", flat=True
        )
    )
    if moved and live:
        raise UserError(
            f"engine {name!r} runs deployments {', '.join(live)}; stop them before changing "
            "its kind or host",
            field="kind" if kind != engine.kind else "host",
        )
    target = {"name": new_name, "kind": kind, "command": command, "options": options}
    changed = [field for field, value in target.items() if getattr(engine, field) != value]
    if host_row != engine.host:
        changed.append("host")
    if env is not None and env != engine.env:
        changed.append("env")
        engine.env = env
    engine.name, engine.kind, engine.command = new_name, kind, command
    engine.options, engine.host = options, host_row
    trusted = ""
    if engine.park_unverified_at is not None and {"kind", "command", "env", "options"} & set(
        changed
    ):
        # Another program, version or setup: a park it kept memory in says nothing of it.
        engine.park_unverified_at = engine.park_check_after = None
        engine.park_unverified_reason = ""
        trusted = " (its models park again: the park that kept memory was another setup's)"
    if {"kind", "command", "env"} & set(changed) and engine.version_checked_at is not None:
        # Another program or setup: its version is read again at its next launch.
        _store_features(engine, EngineFeatures(version="", note=UNKNOWN_UNTIL_HOST))
    engine.save()
    record_event(
        "engine.changed",
        f"engine {engine.name} changed: {', '.join(changed) or 'nothing'}{trusted}",
        subject=engine.name,
        actor=actor,
        host_id=host_row.pk if host_row else None,
    )
    return engine


# A park that did not free memory: the engine's models are stopped rather than parked, and
# a park check at an idle moment, no sooner than this after the last one, checks it again.
PARK_CHECK_INTERVAL = timedelta(minutes=30)


def mark_park_unverified(engine_id: int, reason: str, *, actor: str = "system") -> bool:
    """Remember that a park of this engine left its GPU memory held (``reason``); the next
    park check comes after :data:`PARK_CHECK_INTERVAL`. True when this is news."""
    now = timezone.now()
    with transaction.atomic():
        engine = Engine.objects.select_for_update().get(pk=engine_id)
        news = engine.park_unverified_at is None
        if news:
            engine.park_unverified_at = now
        engine.park_unverified_reason = reason
        engine.park_check_after = now + PARK_CHECK_INTERVAL
        engine.save(update_fields=["park_unverified_at", "park_unverified_reason",
                                   "park_check_after"])  # fmt: skip
    if news:
        record_event(
            "engine.park_unverified",
            f"engine {engine.name}: a park did not free its GPU memory, so its models are "
            f"stopped instead of parked until a park check frees it ({reason})",
            subject=engine.name,
            level=Event.Level.WARNING,
            actor=actor,
        )
    return news


def postpone_park_check(engine_id: int) -> None:
    """A park check of this engine begins: the next comes after :data:`PARK_CHECK_INTERVAL`."""
    later = timezone.now() + PARK_CHECK_INTERVAL
    Engine.objects.filter(pk=engine_id).update(park_check_after=later)


def clear_park_unverified(engine_id: int, how: str, *, actor: str = "system") -> bool:
    """A park of this engine freed its memory (``how``: which one): its models park again.
    True when it had been marked."""
    with transaction.atomic():
        engine = Engine.objects.select_for_update().get(pk=engine_id)
        if engine.park_unverified_at is None:
            return False
        engine.park_unverified_at = engine.park_check_after = None
        engine.park_unverified_reason = ""
        engine.save(update_fields=["park_unverified_at", "park_unverified_reason",
                                   "park_check_after"])  # fmt: skip
    record_event(
        "engine.park_verified",
        f"engine {engine.name}: {how} freed its GPU memory, so its models park again",
        subject=engine.name,
        actor=actor,
    )
    return True
