"""Plain-data views of the objects, shared by ``--json`` listings and ``capyctl status``."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ObjectDoesNotExist
from django.db.models import Count, Q, QuerySet

from capyctl.access.models import ApiKey, Team, UserLimits
from capyctl.deployments.adapters import AdapterView, adapter_views
from capyctl.deployments.models import Deployment
from capyctl.engines.models import Engine
from capyctl.events.models import Event
from capyctl.hosts.models import LOCAL_HOST_NAME, Host
from capyctl.ledger.models import LedgerEntry
from hostagent.kinds import KindError, get_kind


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def engine_data(engine: Engine) -> dict[str, Any]:
    kept = None
    if engine.park_unverified_at is not None:
        kept = {
            "since": _time(engine.park_unverified_at),
            "reason": engine.park_unverified_reason,
            "next_check_after": _time(engine.park_check_after),
        }
    return {
        "name": engine.name,
        "kind": engine.kind,
        "command": engine.command,
        "host": engine.host.name if engine.host else None,
        "parks": engine_parks(engine),
        "park_kept_memory": kept,
        "version": engine.version or None,
        "version_note": engine.version_note,
        "flags": engine.flags,
        "version_checked_at": _time(engine.version_checked_at),
        "created_at": _time(engine.created_at),
    }


def engine_parks(engine: Engine) -> str:
    """``yes``; ``no`` (its kind cannot park); ``kept memory`` (a park of it left its GPU
    memory held: its models are stopped instead until a park check frees memory)."""
    try:
        capabilities = get_kind(engine.kind).capabilities(engine.options, engine.features())
    except KindError:
        return "no"
    if not (capabilities.ram or capabilities.deep):
        return "no"
    return "kept memory" if engine.park_unverified_at is not None else "yes"


def deployment_data(deployment: Deployment) -> dict[str, Any]:
    return {
        "name": deployment.name,
        "aliases": deployment.alias_names,
        "engine": deployment.engine.name,
        "kind": deployment.engine.kind,
        "host": deployment.host.name if deployment.host else None,
        "source": deployment.source,
        "engine_args": deployment.engine_args,
        "gpu_memory_bytes": deployment.gpu_memory_bytes,
        "gpu_memory_fraction": deployment.gpu_memory_fraction,
        "weights_bytes": deployment.weights_bytes,
        "measured_gpu_bytes": deployment.measured_gpu_bytes,
        "measured_weights_bytes": deployment.measured_weights_bytes,
        "weights_copy_bytes": deployment.weights_copy_bytes,
        "measured_residual_bytes": deployment.measured_residual_bytes,
        **deployment.setting_values(),  # each declared setting, as it applies
        "media_domains": list(deployment.media_domains),
        "desired_state": deployment.desired_state,
        "observed_state": deployment.observed_state,
        "parked_mode": deployment.parked_mode or None,
        "state_reason": deployment.state_reason,
        "download": deployment.download or None,
        "source_bytes": deployment.source_bytes,
        "last_request_at": _time(deployment.last_request_at),
        "replica_set": [replica_data(row) for row in replica_rows(deployment)],
    }


def replica_rows(deployment: Deployment) -> list[Deployment]:
    """The deployment's replicas, the first (itself) first."""
    rest = sorted(deployment.replica_set.all(), key=lambda row: row.replica_index)
    return [deployment, *rest]


def replica_data(row: Deployment) -> dict[str, Any]:
    """One replica: where it runs (host, GPUs), its state, and its requests in flight
    (None where this process cannot count them: a command line beside standalone)."""
    from capyctl.scheduler import requests_in_progress  # noqa: PLC0415 - kept off the other listings' start-up

    running = row.instances.exclude(state="exited").values_list("gpu_indices", flat=True)
    return {
        "index": row.replica_index,
        "name": row.name,
        "host": row.host.name if row.host else None,
        "gpus": [int(i) for i in (running[0] if running else [])],
        "in_flight": requests_in_progress.count_if_known(row.pk),
        "observed_state": row.observed_state,
        "parked_mode": row.parked_mode or None,
        "state_reason": row.state_reason,
    }


def key_data(key: ApiKey) -> dict[str, Any]:
    return {
        "id": key.key_id,
        "prefix": key.prefix,
        "user": key.user.get_username(),
        "name": key.name,
        "models": sorted(
            [
                *(d.name for d in key.allowed_models.all()),
                *(a.name for a in key.allowed_adapters.all()),
            ]
        ),
        "all_models": not key.limit_models,  # else only ``models``: none left means none
        "team": key.team.name if key.team is not None else None,
        "priority_class": key.priority_class or None,  # its own (None: its team's)
        "class": key.effective_class,  # its own, else its team's, else interactive
        "admin": key.is_admin,
        "requests_per_minute": key.requests_per_minute,
        "max_concurrent": key.max_concurrent,
        "expires_at": _time(key.expires_at),
        "revoked": key.revoked_at is not None,
        "revoked_at": _time(key.revoked_at),
        "active": key.is_active(),
        "last_used_at": _time(key.last_used_at),
        "requests": key.request_count,
        "prompt_tokens": key.prompt_tokens,
        "completion_tokens": key.completion_tokens,
        "created_at": _time(key.created_at),
    }


def host_data(host: Host) -> dict[str, Any]:
    from capyctl.ledger.pools import pool_usage  # noqa: PLC0415 - kept off the other listings' start-up

    inventory = host.inventory or {}
    return {
        "name": host.name,
        "address": host.address or None,
        "local": host.is_local,
        "state": host.state,
        "draining": host.drain_started_at is not None,
        "probe": inventory.get("probe"),
        "measures": host.measures,
        "measures_reason": inventory.get("measures_reason") or "",
        "unified": bool(inventory.get("unified")),
        "gpus": inventory.get("gpus", []),
        "ram_total_bytes": inventory.get("ram_total_bytes"),
        "pools": [usage.as_dict() for usage in pool_usage(host)],
        "last_seen_at": _time(host.last_seen_at),
    }


def ledger_data(entry: LedgerEntry) -> dict[str, Any]:
    return {
        "host": entry.host.name,
        "pool": entry.pool,
        "deployment": entry.deployment.name if entry.deployment else None,
        "status": entry.status,
        "bytes": entry.bytes,
        "note": entry.note,
    }


def event_data(event: Event) -> dict[str, Any]:
    return {
        "id": event.pk,
        "time": event.created_at.isoformat(),
        "kind": event.kind,
        "level": event.level,
        "subject": event.subject,
        "message": event.message,
        "duration_ms": event.duration_ms,
        "actor": event.actor,
    }


def user_data(user: Any) -> dict[str, Any]:
    return {
        "username": user.get_username(),
        "staff": bool(user.is_staff),
        "active": bool(user.is_active),
        "date_joined": _time(user.date_joined),
        "last_login": _time(user.last_login),
        "keys": user.key_count if hasattr(user, "key_count") else user.api_keys.count(),
        "limits": limits_data(user),
    }


def limits_data(user: Any) -> dict[str, Any]:
    """A user's ceilings (None: none); ``models`` None means every model. The user's
    ``limits`` (and their models) may come prefetched, as :func:`users_query` does."""
    try:
        limits = user.limits
    except ObjectDoesNotExist:
        limits = None
    ceilings = UserLimits.ceilings(limits)
    lifetime = ceilings.key_lifetime
    return {
        "models": sorted(ceilings.models) if ceilings.models is not None else None,
        "requests_per_minute": ceilings.requests_per_minute,
        "max_concurrent": ceilings.max_concurrent,
        "key_lifetime_seconds": int(lifetime.total_seconds()) if lifetime else None,
    }


def users_query() -> QuerySet[Any]:
    """Users by name with their key count (``key_count``) and limits: a listing of any
    length costs the same two queries."""
    return (
        get_user_model()
        .objects.order_by("username")
        .annotate(key_count=Count("api_keys"))
        .select_related("limits")
        .prefetch_related("limits__allowed_models", "limits__allowed_adapters")
    )


def all_users() -> list[Any]:
    return list(users_query())


# The listings below are read here once, for ``capyctl ... list`` and REST's lists alike,
# so the two show the same rows in the same order.


def engines_query() -> QuerySet[Engine]:
    """Engines by name, with their host."""
    return Engine.objects.select_related("host").order_by("name")


def all_teams(name: str | None = None) -> list[Team]:
    """Every team (or the one called ``name``), with its members and keys not revoked."""
    teams = Team.objects.prefetch_related("members").annotate(
        key_count=Count("api_keys", filter=Q(api_keys__revoked_at__isnull=True))
    )
    return list(teams.filter(name=name) if name is not None else teams.order_by("name"))


def team_data(team: Team) -> dict[str, Any]:
    """A team as ``capyctl team list --json`` and REST show it."""
    return {
        "name": team.name,
        "members": sorted(u.get_username() for u in team.members.all()),
        "priority_class": team.priority_class,
        "keys": getattr(team, "key_count", None),  # its keys not revoked
        "created_at": _time(team.created_at),
    }


def all_adapters() -> list[AdapterView]:
    return adapter_views()


def adapter_data(view: AdapterView) -> dict[str, Any]:
    """An adapter as ``capyctl adapter list --json`` and REST show it."""
    return {
        "name": view.name,
        "base": view.base,
        "source": view.source,
        "state": view.state,
        "loaded_on": list(view.loaded_on),
    }


def all_engines() -> list[Engine]:
    return list(engines_query())


def deployments_query() -> QuerySet[Deployment]:
    """Deployments by name (a replica beyond the first is shown within its deployment),
    with their engine, host, aliases and replicas."""
    return (
        Deployment.objects.filter(replica_of__isnull=True)
        .select_related("engine", "host")
        .prefetch_related("aliases", "replica_set__host")
        .order_by("name")
    )


def all_deployments() -> list[Deployment]:
    return list(deployments_query())


def keys_query() -> QuerySet[ApiKey]:
    """API keys, newest first, with their user and allowed models."""
    return (
        ApiKey.objects.select_related("user", "team")
        .prefetch_related("allowed_models", "allowed_adapters")
        .order_by("-created_at", "key_id")
    )


def all_keys(*, user: str | None = None) -> list[ApiKey]:
    """Every key, or ``user``'s keys."""
    keys = keys_query()
    return list(keys.filter(user__username=user) if user else keys)


def hosts_query() -> QuerySet[Host]:
    """Hosts by name."""
    return Host.objects.order_by("name")


def all_hosts() -> list[Host]:
    return list(hosts_query())


def local_host_registered() -> bool:
    """Whether the in-process host ``local`` is registered (a standalone data dir's first
    command registers it)."""
    return Host.objects.filter(name=LOCAL_HOST_NAME).exists()


def status_data() -> dict[str, Any]:
    """Hosts with their pools, engines, deployments, keys and the ledger, at a glance.
    A deployment's ``problem``: what keeps it from ever starting, where that can be told."""
    from capyctl import controlplane  # noqa: PLC0415 - kept off the other listings' start-up
    from capyctl.deployments import problems  # noqa: PLC0415 - kept off the other listings' start-up

    ledger = LedgerEntry.objects.select_related("host", "deployment")
    return {
        "mode": settings.MODE,
        "control_plane": controlplane.state(),
        "hosts": [host_data(host) for host in all_hosts()],
        "engines": [engine_data(e) for e in all_engines()],
        "deployments": [
            {**deployment_data(d), "problem": problems.problem(d)} for d in all_deployments()
        ],
        "adapters": [adapter_data(view) for view in all_adapters()],
        "keys": [key_data(k) for k in all_keys()],
        "ledger": [ledger_data(entry) for entry in ledger],
        "queues": queues_data(),
    }


def queues_data() -> list[dict[str, Any]]:
    """Each model that requests wait for now: how many, how long it has waited for room
    on its host (None: it does not), and the ready models holding the GPUs it waits for
    (their turn). From the serving processes' published queues (and, in server mode,
    the workers' waits in Redis)."""
    from capyctl.gateway import queueview  # noqa: PLC0415 - kept off the other listings' start-up

    view = queueview.read()
    if settings.REDIS_URL:
        from capyctl.scheduler import turns  # noqa: PLC0415 - server mode: the waits in Redis

        for host_id in Host.objects.values_list("pk", flat=True):
            for contender in turns.contenders(host_id):
                into = view.setdefault(contender.name, {"waiting": 0, "room_since": None})
                since = time.time() - contender.waited_seconds
                into["room_since"] = min(since, into["room_since"] or since)
                into.update(host_id=host_id, pools=list(contender.pools))
    if not view:
        return []
    from capyctl.scheduler.snapshots import turn_holders  # noqa: PLC0415 - kept off the other listings' start-up

    holding = turn_holders([
        (name, int(v["host_id"]), tuple(v.get("pools") or ()))
        for name, v in view.items() if v["room_since"] is not None and v.get("host_id")
    ])  # fmt: skip
    out = []
    for name in sorted(view):
        waiting, since = view[name]["waiting"], view[name]["room_since"]
        holders = holding.get(name, [])
        out.append(
            {
                "model": name,
                "waiting": waiting,
                "waiting_for_room_seconds": None if since is None else max(time.time() - since, 0),
                "holders": holders,
            }
        )
    return out


def any_deployments() -> bool:
    """Whether any deployment is registered (a start's banner says what to try next)."""
    return Deployment.objects.exists()
