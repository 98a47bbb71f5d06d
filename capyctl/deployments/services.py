"""Adding, changing and removing deployments. Every entry point calls these.

Validation lives here once: names, aliases (never equal to any deployment's name or
alias), sizes, fractions, the engine and host, engine arguments. Each function either
makes its whole change, with an Event, or raises :class:`UserError` and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.db.models import Q

from capyctl.deployments import guards
from capyctl.deployments.models import (
    Adapter,
    Deployment,
    DeploymentAlias,
    ObservedState,
    ParkPolicy,
)
from capyctl.deployments.settings_spec import SETTING, SETTINGS
from capyctl.engines.models import Engine
from capyctl.engines.services import check_engine_args, get_engine
from capyctl.errors import NotFoundError, UserError
from capyctl.events.services import record_event
from capyctl.hosts.models import Host
from capyctl.hosts.services import get_host
from capyctl.validation import validate_alias, validate_name
from hostagent.kinds import KindError, get_kind
from hostagent.sources import SourceError, check_syntax, engine_source
from hostagent.units import format_size


def _default(name: str) -> Any:
    """A setting's declared default (None: the global default)."""
    return SETTING[name].default


@dataclass
class DeploymentSpec:
    """Everything a person can say about a deployment when adding it: what it is, and
    each setting :mod:`capyctl.deployments.settings_spec` declares (a field of the same
    name, with the declared default)."""

    name: str
    engine: str
    source: str
    aliases: list[str] = field(default_factory=list)
    host: str | None = None
    gpu_memory_bytes: int | None = None
    gpu_memory_fraction: float | None = None
    weights_bytes: int | None = None
    engine_args: list[str] = field(default_factory=list)
    media_domains: list[str] = field(default_factory=list)
    # The declared settings.
    gpus: int = _default("gpus")
    replicas: int = _default("replicas")
    min_replicas: int = _default("min_replicas")
    target_concurrency: int | None = None
    scale_up_wait_seconds: int | None = None
    spread: str = _default("spread")
    routing: str = _default("routing")
    adapter_slots: int = _default("adapter_slots")
    adapter_max_rank: int = _default("adapter_max_rank")
    park: str = _default("park")
    pinned: bool = _default("pinned")
    over_claim: str = _default("over_claim")
    priority: int = _default("priority")
    price_prompt: float = _default("price_prompt")
    price_completion: float = _default("price_completion")
    price_gpu_hour: float = _default("price_gpu_hour")
    idle_park_seconds: int | None = None
    min_ready_seconds: int | None = None
    max_waiting: int | None = None
    max_queue_seconds: int | None = None
    max_turn_seconds: int | None = None
    wake_timeout_seconds: int | None = None
    start_timeout_seconds: int | None = None
    drain_timeout_seconds: int | None = None
    max_tokens_ceiling: int = _default("max_tokens_ceiling")
    n_ceiling: int = _default("n_ceiling")
    best_of_ceiling: int = _default("best_of_ceiling")


def get_deployment(name: str) -> Deployment:
    """The deployment called ``name`` (or with that alias)."""
    found = (
        Deployment.objects.select_related("engine", "host")
        .filter(Q(name=name) | Q(aliases__name=name), replica_of__isnull=True)
        .first()
    )
    if found is None:
        raise NotFoundError(f"no deployment named {name!r}", field="name")
    return found


def download_state(deployment_id: int) -> tuple[str | None, dict[str, Any] | None]:
    """The deployment's observed state and its download's progress as last written (a
    :class:`hostagent.sources.FetchStatus` as a dict; None before any); (None, None) once
    the deployment is gone."""
    row = Deployment.objects.filter(pk=deployment_id).values("observed_state", "download")
    found = row.first()
    if found is None:
        return None, None
    return found["observed_state"], found["download"] or None


def fetched_sources() -> list[str]:
    """What each deployment is fetched as (a bare Hugging Face id keeps its ``hf://``
    download), and each adapter: the downloads a prune of the model cache keeps."""
    return [
        *(
            engine_source(d.source, d.engine.kind, d.engine.options or {})
            for d in Deployment.objects.select_related("engine")
        ),
        *Adapter.objects.values_list("source", flat=True),  # fetched as they are given
    ]


def _check_names(spec: DeploymentSpec, *, exclude_pk: int | None = None) -> None:
    validate_name(spec.name, what="deployment name")
    seen: set[str] = set()
    for alias in spec.aliases:
        validate_alias(alias)
        if alias == spec.name:
            raise UserError(f"alias {alias!r} is the deployment's own name", field="aliases")
        if alias in seen:
            raise UserError(f"alias {alias!r} is given twice", field="aliases")
        seen.add(alias)

    others = Deployment.objects.all()
    other_aliases = DeploymentAlias.objects.all()
    if exclude_pk is not None:
        others = others.exclude(pk=exclude_pk)
        other_aliases = other_aliases.exclude(deployment_id=exclude_pk)
    if others.filter(name=spec.name).exists():
        raise UserError(f"a deployment named {spec.name!r} already exists", field="name")
    owner = other_aliases.filter(name=spec.name).select_related("deployment").first()
    if owner is not None:
        raise UserError(
            f"name {spec.name!r} is already an alias of deployment {owner.deployment.name!r}",
            field="name",
        )
    for given in (spec.name, *spec.aliases):
        adapter = Adapter.objects.filter(name=given).values_list("base__name", flat=True).first()
        if adapter is not None:
            raise UserError(
                f"{given!r} is already the name of an adapter on {adapter!r}",
                field="name" if given == spec.name else "aliases",
            )
    if spec.aliases:
        clash = others.filter(name__in=spec.aliases).values_list("name", flat=True).first()
        if clash is not None:
            raise UserError(
                f"alias {clash!r} is already the name of another deployment", field="aliases"
            )
        taken = other_aliases.filter(name__in=spec.aliases).select_related("deployment").first()
        if taken is not None:
            raise UserError(
                f"alias {taken.name!r} is already an alias of deployment {taken.deployment.name!r}",
                field="aliases",
            )


def _check_figures(spec: DeploymentSpec) -> None:
    if spec.gpu_memory_bytes is not None and spec.gpu_memory_fraction is not None:
        raise UserError("give gpu memory as bytes or as a fraction, not both", field="gpu_memory")
    if spec.gpu_memory_bytes is not None and spec.gpu_memory_bytes <= 0:
        raise UserError("gpu memory must be more than 0 bytes", field="gpu_memory")
    if spec.gpu_memory_fraction is not None and not 0 < spec.gpu_memory_fraction <= 1:
        raise UserError(
            f"invalid gpu memory fraction {spec.gpu_memory_fraction}: it must lie in (0, 1]",
            field="gpu_memory",
        )
    if spec.weights_bytes is not None and spec.weights_bytes <= 0:
        raise UserError("weights size must be more than 0 bytes", field="weights_bytes")
    _check_settings(spec)
    if spec.gpus == 0 and (spec.gpu_memory_bytes or spec.gpu_memory_fraction):
        raise UserError("a deployment with 0 GPUs cannot claim gpu memory", field="gpu_memory")
    if not spec.source.strip():
        raise UserError(
            "a deployment needs a source (a path, hf://ORG/NAME or a URL)", field="source"
        )


def _check_settings(spec: DeploymentSpec) -> None:
    """Each declared setting within its bounds or choices, and its request guards' media
    domains."""
    for setting in SETTINGS:
        wrong = setting.check(getattr(spec, setting.name))
        if wrong is not None:
            raise UserError(wrong, field=setting.name)
    if spec.min_replicas > spec.replicas:
        raise UserError(
            f"invalid minimum replicas {spec.min_replicas}: more than its replicas "
            f"{spec.replicas} (use --replicas MIN:MAX with MIN at most MAX)",
            field="min_replicas",
        )
    if not isinstance(spec.media_domains, list):
        raise UserError("media domains must be a list of host names", field="media_domains")
    try:
        # Kept as the engines compare them: lowercase, each once.
        spec.media_domains = guards.check_domains(spec.media_domains)
    except ValueError as exc:
        raise UserError(str(exc), field="media_domains") from None


def _check_source(source: str) -> None:
    if any(ch in source for ch in "\n\r\0"):
        raise UserError(
            f"invalid source {source!r}: it contains control characters", field="source"
        )
    try:
        check_syntax(source)
    except SourceError as exc:
        raise UserError(str(exc), field="source") from None


def check_deployment(
    spec: DeploymentSpec, *, exclude_pk: int | None = None
) -> tuple[Engine, Host | None]:
    """Validate ``spec``; return its engine and host rows, or raise :class:`UserError`."""
    _check_names(spec, exclude_pk=exclude_pk)
    _check_figures(spec)
    _check_source(spec.source)
    engine = get_engine(spec.engine)
    kind = get_kind(engine.kind)
    # A flag the installed program lacks says the most: before CapyCTL's own reservations.
    check_engine_args(engine, spec.engine_args)
    try:
        kind.check_args(spec.engine_args)
    except KindError as exc:
        raise UserError(str(exc), field="engine_args") from None
    if spec.park in (ParkPolicy.RAM, ParkPolicy.DEEP):
        capabilities = kind.capabilities(engine.options, engine.features())
        able = capabilities.ram if spec.park == ParkPolicy.RAM else capabilities.deep
        if not able:
            raise UserError(
                f"engine {engine.name!r} ({engine.kind}) cannot park {spec.park!r}; "
                "use --park auto, stop or never",
                field="park",
            )
    if spec.adapter_slots and not kind.capabilities(engine.options, engine.features()).adapters:
        raise UserError(
            f"engine {engine.name!r} ({engine.kind}) cannot serve adapters; leave its adapter "
            "slots at 0",
            field="adapter_slots",
        )
    host = get_host(spec.host) if spec.host else engine.host
    if engine.host is not None and host is not None and host.pk != engine.host.pk:
        raise UserError(
            f"engine {engine.name!r} is installed on host {engine.host.name!r}, not {host.name!r}",
            field="host",
        )
    return engine, host


# Settings a person gives as plain values, the same in every entry point.
SETTING_FIELDS = tuple(setting.name for setting in SETTINGS)
# What an engine is launched with: a change reaches a running engine at its next start
# (the gateway applies a new media policy at once; the engine's own flag, then).
_LAUNCH_FIELDS = frozenset(
    {
        "source",
        "engine_args",
        "gpu_memory_bytes",
        "gpu_memory_fraction",
        "weights_bytes",
        "gpus",
        "media_domains",
    }
)
_SPEC_FIELDS = (
    "source",
    "engine_args",
    "gpu_memory_bytes",
    "gpu_memory_fraction",
    "weights_bytes",
    "media_domains",
    *SETTING_FIELDS,
)


def _describe_memory(spec: DeploymentSpec) -> str:
    if spec.gpu_memory_bytes is not None:
        return f"{format_size(spec.gpu_memory_bytes)} per GPU"
    if spec.gpu_memory_fraction is not None:
        return f"{spec.gpu_memory_fraction:g} of each GPU"
    return "estimated"


def spec_of(deployment: Deployment) -> DeploymentSpec:
    """The spec that describes ``deployment`` as it is now."""
    return DeploymentSpec(
        name=deployment.name,
        engine=deployment.engine.name,
        # The host a person chose; one its placement chose is not part of what it is.
        host=deployment.host.name if deployment.host and deployment.host_chosen else None,
        aliases=deployment.alias_names,
        **{name: getattr(deployment, name) for name in _SPEC_FIELDS},
    )


@transaction.atomic
def add_deployment(spec: DeploymentSpec, *, actor: str = "") -> Deployment:
    """Add a deployment (desired state ``running``, observed ``stopped``)."""
    engine, host = check_deployment(spec)
    deployment = Deployment.objects.create(
        name=spec.name,
        engine=engine,
        host=host,
        host_chosen=host is not None,
        **{name: getattr(spec, name) for name in _SPEC_FIELDS},
    )
    DeploymentAlias.objects.bulk_create(
        [DeploymentAlias(name=alias, deployment=deployment) for alias in spec.aliases]
    )
    _sync_replicas(deployment, host_changed=True)
    record_event(
        "deployment.added",
        f"deployment {spec.name} added: engine {engine.name}, source {spec.source}, "
        f"gpu memory {_describe_memory(spec)}",
        subject=spec.name,
        actor=actor,
        deployment_id=deployment.pk,
        host_id=host.pk if host else None,
    )
    return deployment


@transaction.atomic
def update_deployment(name: str, spec: DeploymentSpec, *, actor: str = "") -> Deployment:
    """Change a deployment's settings. Engine, host and name change only while stopped;
    the new figures apply from its next start."""
    # Decide on the row as it is under the lock: the scheduler may have changed its state
    # since any earlier read, and only the fields a person sets are written back.
    deployment = (
        Deployment.objects.select_for_update(of=("self",))
        .select_related("engine", "host")
        .get(pk=get_deployment(name).pk)
    )
    engine, host = check_deployment(spec, exclude_pk=deployment.pk)
    # A host a person names is chosen; the host it was placed on, named back (the admin's
    # form, a REST body read and sent again), changes nothing.
    chosen = host is not None and (deployment.host_chosen or host.pk != deployment.host_id)
    if host is None and not deployment.host_chosen:
        host = deployment.host  # where its placement put it, until a person says otherwise
    moved = (
        spec.name != deployment.name
        or engine.pk != deployment.engine_id
        or (host.pk if host else None) != deployment.host_id
    )
    if moved:
        for row in (deployment, *deployment.replica_set.all()):
            if row.observed_state != ObservedState.STOPPED:
                raise UserError(
                    f"deployment {row.name!r} is {row.observed_state}; stop "
                    f"{deployment.name!r} before changing its name, engine or host",
                    field="name",
                )
    host_changed = (host.pk if host else None) != deployment.host_id
    changed = [
        field for field in _SPEC_FIELDS if getattr(deployment, field) != getattr(spec, field)
    ]
    deployment.name = spec.name
    deployment.engine = engine
    deployment.host = host
    deployment.host_chosen = chosen
    for name_ in _SPEC_FIELDS:
        setattr(deployment, name_, getattr(spec, name_))
    deployment.save(
        update_fields=["name", "engine", "host", "host_chosen", *_SPEC_FIELDS, "updated_at"]
    )
    if sorted(spec.aliases) != sorted(deployment.alias_names):
        changed.append("aliases")
        deployment.aliases.all().delete()
        DeploymentAlias.objects.bulk_create(
            [DeploymentAlias(name=alias, deployment=deployment) for alias in spec.aliases]
        )
    _sync_replicas(deployment, host_changed=host_changed)
    if moved or _LAUNCH_FIELDS.intersection(changed):
        # What its parks left was measured on its engine as launched: from its next start
        # it may leave something else, so its parks are counted on the guess until one
        # measures it again.
        Deployment.objects.filter(Q(pk=deployment.pk) | Q(replica_of=deployment)).update(
            measured_residual_bytes=None
        )
    if moved:
        changed.append("name/engine/host")
    message = f"deployment {spec.name} changed: {', '.join(changed) or 'nothing'}"
    running = deployment.observed_state not in (ObservedState.STOPPED, ObservedState.FAILED)
    if running and _LAUNCH_FIELDS.intersection(changed):
        message += "; its engine keeps what it was started with until its next start"
    record_event(
        "deployment.changed",
        message,
        subject=spec.name,
        actor=actor,
        deployment_id=deployment.pk,
    )
    return deployment


def replica_name(name: str, index: int) -> str:
    """The row name of a deployment's replica ``index`` (1 and up): ``NAME~INDEX``, which
    no deployment name or alias can be (``~`` is in neither)."""
    return f"{name}~{index}"


def _check_removable(row: Deployment, name: str, *, then: str = "") -> None:
    """Raise unless ``row`` (the deployment ``name``, or one of its replicas) holds no
    engine and no memory; ``then``: what to do after stopping it, for the message."""
    who = f"deployment {row.name!r}" if row.name == name else f"its replica {row.name}"
    stop = f"stop {'it' if row.name == name else name} first{then}"
    if row.observed_state not in (ObservedState.STOPPED, ObservedState.FAILED):
        raise UserError(f"{who} is {row.observed_state}; {stop}", field="name")
    if row.instances.exclude(state="exited").exists():
        raise UserError(f"{who} still has an engine process; {stop}", field="name")
    if row.ledger_entries.exists():
        raise UserError(
            f"{who} still counts memory in the ledger (not yet confirmed released); try "
            "again once the probe confirms it",
            field="name",
        )


def _sync_replicas(first: Deployment, *, host_changed: bool) -> None:
    """Make the replica rows of ``first`` match its ``replicas`` setting: rows 1 to
    replicas - 1, each with its settings (its host too where ``host_changed``: one a person
    gave; a host its placement chose stays its own). A row past the setting is removed,
    once stopped; while it runs, the change is refused and nothing is changed."""
    existing = {row.replica_index: row for row in first.replica_set.select_for_update()}
    copied = {name: getattr(first, name) for name in _SPEC_FIELDS}
    for index in range(1, first.replicas):
        row = existing.pop(index, None)
        if row is None:
            Deployment.objects.create(
                name=replica_name(first.name, index),
                engine=first.engine,
                host=first.host if first.host_chosen else None,
                host_chosen=first.host_chosen,
                replica_of=first,
                replica_index=index,
                # Its desired state is the scheduler's to write (a start or stop of the
                # deployment writes its replicas' too); requests follow the first's.
                **copied,
            )
            continue
        row.name = replica_name(first.name, index)
        row.engine = first.engine
        fields = ["name", "engine", *_SPEC_FIELDS, "updated_at"]
        if host_changed:
            row.host = first.host if first.host_chosen else None
            row.host_chosen = first.host_chosen
            fields += ["host", "host_chosen"]
        for name, value in copied.items():
            setattr(row, name, value)
        row.save(update_fields=fields)
    for _index, row in sorted(existing.items()):
        try:
            _check_removable(row, first.name, then=", then lower them")
        except UserError as exc:
            raise UserError(
                f"cannot lower {first.name}'s replicas to {first.replicas}: {exc}",
                field="replicas",
            ) from None
        row.delete()


@transaction.atomic
def remove_deployment(name: str, *, actor: str = "") -> None:
    """Remove a stopped deployment (with its replicas). Its model files are never
    touched."""
    deployment = get_deployment(name)
    for row in (deployment, *deployment.replica_set.all()):
        _check_removable(row, deployment.name)
    adapters = list(deployment.adapters.values_list("name", flat=True))
    if adapters:
        raise UserError(
            f"deployment {deployment.name!r} is the base of adapters {', '.join(adapters)}; "
            "remove them first (capyctl adapter remove NAME)",
            field="name",
        )
    deployment_name = deployment.name
    deployment.delete()
    record_event(
        "deployment.removed",
        f"deployment {deployment_name} removed (its model files were left in place)",
        subject=deployment_name,
        actor=actor,
    )
