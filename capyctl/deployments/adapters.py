"""Adapters: LoRA fine-tunes named as models, each served by its base deployment's engine.

Validation lives here once, for the CLI, REST and the admin: an adapter's name is a
lowercase DNS label that no deployment, alias or other adapter has; its base is a
deployment (not a replica row) given adapter slots, whose engine kind can serve adapters;
its source is checked as a deployment's is, and fetched on its base's host when first
loaded. Which engines hold an adapter is the scheduler's (:class:`LoadedAdapter`).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction

from capyctl.deployments.models import Adapter, Deployment, DeploymentAlias, LoadedAdapter
from capyctl.deployments.services import _check_source, get_deployment
from capyctl.errors import NotFoundError, UserError
from capyctl.events.services import record_event
from capyctl.validation import validate_name
from hostagent.kinds import get_kind

# An adapter as ``/v1/models``, ``capyctl adapter list`` and REST show it.
LOADED = "loaded"  # held by a running engine of its base
FETCHED = "on the host"  # its files are on its base's host, not loaded
NOT_FETCHED = "not fetched"


@dataclass(frozen=True)
class AdapterView:
    pk: int
    name: str
    base: str
    source: str
    state: str
    loaded_on: tuple[str, ...]  # the replicas (rows) of its base whose engines hold it
    created: int  # seconds since the epoch


def get_adapter(name: str) -> Adapter:
    found = Adapter.objects.select_related("base").filter(name=name).first()
    if found is None:
        raise NotFoundError(f"no adapter named {name!r}", field="name")
    return found


def check_base(base: Deployment) -> None:
    """Refuse, in one line, a base that cannot serve adapters: a replica row, one with no
    adapter slots, or an engine kind that loads none."""
    if base.replica_of_id is not None:
        raise UserError(f"{base.name} is a replica; name its deployment", field="base")
    engine = base.engine
    if not get_kind(engine.kind).capabilities(engine.options, engine.features()).adapters:
        raise UserError(
            f"deployment {base.name!r} runs engine {engine.name!r} ({engine.kind}), which "
            "cannot serve adapters; use a vllm, sglang or llamacpp engine",
            field="base",
        )
    if base.adapter_slots < 1:
        raise UserError(
            f"deployment {base.name!r} has no adapter slots; give it some first: capyctl "
            f"deployment update {base.name} --adapter-slots N",
            field="base",
        )
    kind = get_kind(engine.kind).capabilities(engine.options, engine.features())
    held = Adapter.objects.filter(base=base).count()
    if not kind.runtime_adapters and held >= base.adapter_slots:
        raise UserError(
            f"{engine.kind} takes its adapters at launch, one a slot: {base.name}'s "
            f"{base.adapter_slots} slot(s) are all named; give it more first: capyctl "
            f"deployment update {base.name} --adapter-slots N",
            field="base",
        )


def _check_name(name: str) -> None:
    validate_name(name, what="adapter name")
    if Adapter.objects.filter(name=name).exists():
        raise UserError(f"an adapter named {name!r} already exists", field="name")
    deployment = Deployment.objects.filter(name=name).exists()
    alias = DeploymentAlias.objects.filter(name=name).select_related("deployment").first()
    if deployment or alias is not None:
        owner = f"deployment {name!r}" if deployment else f"an alias of {alias.deployment.name!r}"  # type: ignore[union-attr]
        raise UserError(f"{name!r} is already the name of {owner}", field="name")


def check_adapter(name: str, base: str, source: str) -> Deployment:
    """Refuse, naming the field, an adapter that cannot be added; return its base."""
    _check_name(name)
    base_row = get_deployment(base)
    check_base(base_row)
    _check_source(source)
    return base_row


@transaction.atomic
def add_adapter(name: str, base: str, source: str, *, actor: str = "") -> Adapter:
    """Add the adapter ``name`` on the deployment ``base``, from ``source``; it is fetched
    and loaded when first asked for."""
    base_row = check_adapter(name, base, source)
    adapter = Adapter.objects.create(name=name, base=base_row, source=source)
    record_event(
        "adapter.added",
        f"adapter {name} added on {base_row.name} (source {source}); it loads when first asked for",
        subject=name,
        actor=actor,
    )
    return adapter


def remove_adapter(name: str, *, actor: str = "") -> None:
    """Remove the adapter ``name``: refused while an engine holds it."""
    adapter = get_adapter(name)
    held = LoadedAdapter.objects.filter(adapter=adapter, instance__state="running").exists()
    if held:
        raise UserError(
            f"adapter {name!r} is loaded in {adapter.base.name}'s engine; it can be removed "
            f"once unloaded (to make room for another, or when {adapter.base.name} is parked "
            "deep or stopped)",
            field="name",
        )
    adapter.delete()
    record_event(
        "adapter.removed",
        f"adapter {name} removed from {adapter.base.name} (its files were left in place)",
        subject=name,
        actor=actor,
    )


def adapter_views(names: list[str] | None = None) -> list[AdapterView]:
    """Every adapter (or those named), with where it stands."""
    rows = Adapter.objects.select_related("base").order_by("name")
    if names is not None:
        rows = rows.filter(name__in=names)
    loaded: dict[int, list[str]] = {}
    for adapter_id, row_name in LoadedAdapter.objects.filter(
        adapter__in=rows, instance__state="running"
    ).values_list("adapter_id", "instance__deployment__name"):
        loaded.setdefault(adapter_id, []).append(row_name)
    views = []
    for row in rows:
        where = tuple(sorted(loaded.get(row.pk, [])))
        if where:
            state = LOADED
        elif row.source_bytes is not None or row.source.startswith("/"):
            state = FETCHED
        else:
            state = NOT_FETCHED
        views.append(AdapterView(row.pk, row.name, row.base.name, row.source, state, where,
                                 int(row.created_at.timestamp())))  # fmt: skip
    return views
