"""Models served by engines (deployments) and the engine processes running them."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from capyctl.deployments import guards
from capyctl.deployments.settings_spec import COUNT, PRICE, SETTING, SETTINGS


class ParkPolicy(models.TextChoices):
    """How a deployment gives back GPU memory when another model needs it."""

    AUTO = "auto"  # ram on a discrete GPU when the copy fits, deep on unified memory, else stop
    RAM = "ram"
    DEEP = "deep"
    STOP = "stop"
    NEVER = "never"


class OverClaim(models.TextChoices):
    """What a start does when its engine is measured holding more than its claim."""

    STOP = "stop"  # the engine is stopped and the deployment fails, saying by how much
    RAISE = "raise"  # the claim is raised to what it was measured holding


class Spread(models.TextChoices):
    """Where a deployment's replicas go."""

    HOSTS = "hosts"  # hosts with fewer of its replicas first
    GPUS = "gpus"  # any free GPUs, in host order


class Routing(models.TextChoices):
    """How a request picks among a deployment's ready replicas."""

    AFFINITY = "affinity"  # the same session or prompt start to the same one, within a bound
    LEAST_LOAD = "least-load"  # the one with the fewest requests in flight


class DesiredState(models.TextChoices):
    RUNNING = "running"
    STOPPED = "stopped"


class ObservedState(models.TextChoices):
    """The scheduler's view of a deployment; only the scheduler writes it."""

    STOPPED = "stopped"
    DOWNLOADING = "downloading"  # fetching an hf:// or http(s):// source on its host
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    PARKING = "parking"
    PARKED = "parked"
    WAKING = "waking"
    STOPPING = "stopping"
    FAILED = "failed"


class ParkMode(models.TextChoices):
    RAM = "ram"
    DEEP = "deep"


def declared(name: str) -> dict[str, Any]:
    """A setting's field options as :mod:`capyctl.deployments.settings_spec` declares it:
    its default (none: the global one), bounds and help."""
    setting = SETTING[name]
    options: dict[str, Any] = {"help_text": setting.model_help()}
    if setting.default is not None:
        options["default"] = setting.default
    if setting.kind in (COUNT, PRICE):
        options["validators"] = [
            *([MinValueValidator(setting.minimum)] if setting.minimum is not None else []),
            *([MaxValueValidator(setting.maximum)] if setting.maximum is not None else []),
        ]
    return options


class Deployment(models.Model):
    """A model served by an engine on a host — what users call "a model".

    ``name`` (and any alias) is what requests put in ``"model"``. Memory figures are bytes:
    ``gpu_memory_bytes`` per GPU, or ``gpu_memory_fraction`` of each device; both empty
    means "estimate from engine args or the model files". ``weights_bytes`` is the size of
    the weights copy a ``ram`` park keeps in host RAM. The ``measured_*`` figures replace
    the estimates once the engine has run. Per-deployment timing and queue settings left
    empty fall back to the global defaults (``settings.CAPYCTL``).

    ``desired_state`` is set by people; ``observed_state`` (with ``parked_mode`` and
    ``state_reason``) is owned by the scheduler and changed only by conditional updates.
    """

    name = models.CharField(max_length=72, unique=True)  # a DNS label, or a replica's NAME~N
    engine = models.ForeignKey(
        "engines.Engine", on_delete=models.PROTECT, related_name="deployments"
    )
    host = models.ForeignKey(
        "hosts.Host",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="deployments",
        help_text="where it runs; empty = placed where it fits on first start",
    )
    # Whether a person chose its host (else its placement did, and a host drain may move it).
    host_chosen = models.BooleanField(default=False, editable=False)
    source = models.CharField(max_length=1024, help_text="local path, hf://ORG/NAME or URL")
    engine_args = models.JSONField(default=list, blank=True, help_text="extra engine arguments")

    gpu_memory_bytes = models.BigIntegerField(null=True, blank=True)
    gpu_memory_fraction = models.FloatField(null=True, blank=True)
    weights_bytes = models.BigIntegerField(null=True, blank=True)
    gpus = models.PositiveSmallIntegerField(**declared("gpus"))
    replicas = models.PositiveSmallIntegerField(**declared("replicas"))
    min_replicas = models.PositiveSmallIntegerField(**declared("min_replicas"))
    target_concurrency = models.PositiveIntegerField(
        null=True, blank=True, **declared("target_concurrency")
    )
    scale_up_wait_seconds = models.PositiveIntegerField(
        null=True, blank=True, **declared("scale_up_wait_seconds")
    )
    spread = models.CharField(max_length=8, choices=Spread.choices, **declared("spread"))
    routing = models.CharField(max_length=12, choices=Routing.choices, **declared("routing"))
    adapter_slots = models.PositiveSmallIntegerField(**declared("adapter_slots"))
    adapter_max_rank = models.PositiveSmallIntegerField(**declared("adapter_max_rank"))
    # A replica beyond the first is a row of its own (its own host, GPUs, engine, state
    # and ledger entries) named NAME~INDEX, made and kept in step with its first replica
    # by the deployments' services; people see and name only the first.
    replica_of = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="replica_set",
        help_text="the deployment this row is a replica of (empty: the deployment itself)",
    )
    replica_index = models.PositiveSmallIntegerField(default=0)
    measured_gpu_bytes = models.BigIntegerField(null=True, blank=True)
    measured_weights_bytes = models.BigIntegerField(null=True, blank=True)
    measured_residual_bytes = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="what its last confirmed park left on each of its GPUs (the most): the "
        "residual the scheduler counts on when it parks it again",
    )

    # The settings people give it, each declared in capyctl.deployments.settings_spec.
    park = models.CharField(max_length=8, choices=ParkPolicy.choices, **declared("park"))
    pinned = models.BooleanField(**declared("pinned"))
    over_claim = models.CharField(max_length=8, choices=OverClaim.choices, **declared("over_claim"))
    priority = models.IntegerField(**declared("priority"))
    idle_park_seconds = models.PositiveIntegerField(
        null=True, blank=True, **declared("idle_park_seconds")
    )
    min_ready_seconds = models.PositiveIntegerField(
        null=True, blank=True, **declared("min_ready_seconds")
    )
    max_waiting = models.PositiveIntegerField(null=True, blank=True, **declared("max_waiting"))
    max_queue_seconds = models.PositiveIntegerField(
        null=True, blank=True, **declared("max_queue_seconds")
    )
    max_turn_seconds = models.PositiveIntegerField(
        null=True, blank=True, **declared("max_turn_seconds")
    )
    wake_timeout_seconds = models.PositiveIntegerField(
        null=True, blank=True, **declared("wake_timeout_seconds")
    )
    start_timeout_seconds = models.PositiveIntegerField(
        null=True, blank=True, **declared("start_timeout_seconds")
    )
    drain_timeout_seconds = models.PositiveIntegerField(
        null=True, blank=True, **declared("drain_timeout_seconds")
    )
    # What one /v1 request may ask of it (capyctl.deployments.guards declares each).
    max_tokens_ceiling = models.PositiveIntegerField(**declared("max_tokens_ceiling"))
    n_ceiling = models.PositiveIntegerField(**declared("n_ceiling"))
    best_of_ceiling = models.PositiveIntegerField(**declared("best_of_ceiling"))
    price_prompt = models.FloatField(**declared("price_prompt"))
    price_completion = models.FloatField(**declared("price_completion"))
    price_gpu_hour = models.FloatField(**declared("price_gpu_hour"))
    media_domains = models.JSONField(
        default=list,
        blank=True,
        help_text="hosts whose http(s) media URLs requests may name (empty: data: URLs only)",
    )

    desired_state = models.CharField(
        max_length=8, choices=DesiredState.choices, default=DesiredState.RUNNING
    )
    observed_state = models.CharField(
        max_length=16, choices=ObservedState.choices, default=ObservedState.STOPPED
    )
    parked_mode = models.CharField(max_length=8, choices=ParkMode.choices, blank=True)
    state_reason = models.TextField(blank=True)
    download = models.JSONField(
        default=dict, blank=True, help_text="the source's last fetch: bytes, rate, ETA, outcome"
    )
    source_bytes = models.BigIntegerField(
        null=True, blank=True, help_text="size of the weights at the source, once fetched"
    )
    state_changed_at = models.DateTimeField(null=True, blank=True)
    last_request_at = models.DateTimeField(null=True, blank=True)

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(gpu_memory_bytes__isnull=True)
                | models.Q(gpu_memory_fraction__isnull=True),
                name="deployment_gpu_memory_bytes_or_fraction",
            ),
            models.CheckConstraint(
                condition=models.Q(gpu_memory_fraction__isnull=True)
                | (models.Q(gpu_memory_fraction__gt=0) & models.Q(gpu_memory_fraction__lte=1)),
                name="deployment_gpu_memory_fraction_range",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def save(self, *args: Any, **kwargs: Any) -> None:
        """A new row, or the named fields of an existing one: a full save would write back
        ``observed_state`` as it was read, undoing what the scheduler did meanwhile (its
        state is written only by :mod:`capyctl.scheduler.transitions`)."""
        if not self._state.adding and kwargs.get("update_fields") is None:
            raise TypeError("Deployment.save() of an existing row needs update_fields")
        super().save(*args, **kwargs)

    def setting(self, name: str) -> int:
        """A setting with a global default (timing, queue): this deployment's own, else the
        global default its declaration names (one whose 0 means another setting's value,
        as ``max_queue_seconds``'s means its wake timeout: that setting)."""
        declared_ = SETTING[name]
        own = getattr(self, name)
        if own is not None:
            return int(own)
        if declared_.global_key is None:
            raise KeyError(f"{name} has no global default")
        default = int(settings.CAPYCTL[declared_.global_key])
        if default == 0 and declared_.zero_means:
            return self.setting(declared_.zero_means)
        return default

    def setting_values(self) -> dict[str, Any]:
        """Every declared setting as it applies (an empty one: its global default), by
        name, in the declared order: what listings show."""
        return {
            s.name: self.setting(s.name) if s.global_key else getattr(self, s.name)
            for s in SETTINGS
        }

    @property
    def served_name(self) -> str:
        """The model name its engine serves and requests use: its own, or for a replica
        (``NAME~INDEX``) its deployment's."""
        return self.name.partition("~")[0]

    @property
    def movable(self) -> bool:
        """Whether the scheduler may place it on another host than its own (a drain): a
        person chose neither its host nor an engine installed on one host."""
        return not self.host_chosen and self.engine.host_id is None

    @property
    def kept_up(self) -> int:
        """How many of its replicas are kept up while it serves (its ``min_replicas``, or
        all of them)."""
        return self.min_replicas or self.replicas

    @property
    def ceilings(self) -> dict[str, int]:
        """Its request ceilings, by field name (``max_tokens_ceiling``...)."""
        return {ceiling.name: int(getattr(self, ceiling.name)) for ceiling in guards.CEILINGS}

    @property
    def weights_copy_bytes(self) -> int | None:
        """The weights copy a ``ram`` park promises in host RAM, once known: the larger of
        the declared ``weights_bytes`` and the copy its last ``ram`` park measured."""
        known = [b for b in (self.weights_bytes, self.measured_weights_bytes) if b]
        return max(known) if known else None

    @property
    def alias_names(self) -> list[str]:
        return [alias.name for alias in self.aliases.all()]


class DeploymentAlias(models.Model):
    """Another name a deployment answers to. Unique across all aliases; the service layer
    also keeps it from equalling any deployment's name."""

    name = models.CharField(max_length=128, unique=True)
    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="aliases")

    class Meta:
        ordering = ["name"]
        verbose_name_plural = "deployment aliases"

    def __str__(self) -> str:
        return self.name


class Adapter(models.Model):
    """A LoRA fine-tune served by its base deployment's engine, under a name of its own:
    to the callers of ``/v1`` a model like any other. Its name shares the namespace of
    deployments and their aliases (the service layer keeps them apart). Which engines hold
    it loaded is :class:`LoadedAdapter`'s, written by the scheduler alone."""

    name = models.CharField(max_length=128, unique=True)
    base = models.ForeignKey(Deployment, on_delete=models.PROTECT, related_name="adapters")
    source = models.CharField(max_length=1024, help_text="local path, hf://ORG/NAME or URL")
    source_bytes = models.BigIntegerField(
        null=True, blank=True, help_text="size of its files, once fetched"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def ref_of(pk: int) -> int:
        """How key allowlists (:class:`capyctl.gateway.keys.KeyInfo`) and the counts of
        requests in flight hold the adapter ``pk`` beside deployments' ids: negative, so
        the two never meet."""
        return -pk

    @property
    def ref(self) -> int:
        return self.ref_of(self.pk)


class LoadedAdapter(models.Model):
    """An adapter held by one engine process of its base: written only by
    :mod:`capyctl.scheduler.actions.adapters` (a load, an unload, a deep park or an end of
    the engine that dropped it)."""

    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="loads")
    instance = models.ForeignKey(
        "deployments.Instance", on_delete=models.CASCADE, related_name="adapters"
    )
    loaded_at = models.DateTimeField(auto_now_add=True)
    load_seconds = models.FloatField(default=0.0)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # Where an engine takes its adapters at launch only (llama-server): its place in the
    # launch's list, which requests name it by; None for engines that load at run time.
    slot = models.PositiveSmallIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["loaded_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["adapter", "instance"], name="loaded_adapter_once_per_instance"
            )
        ]

    def __str__(self) -> str:
        return f"{self.adapter_id} on {self.instance_id}"


class Instance(models.Model):
    """One engine process launched for a deployment.

    ``launch_key`` is the API key made for this launch; CapyCTL swaps it in for the
    client's key when forwarding. The engine listens on the Unix socket ``socket_path`` of
    its host where its program can, else on ``127.0.0.1:port``.
    """

    class State(models.TextChoices):
        LAUNCHING = "launching"
        RUNNING = "running"
        EXITED = "exited"

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="instances")
    host = models.ForeignKey("hosts.Host", on_delete=models.PROTECT, related_name="instances")
    state = models.CharField(max_length=16, choices=State.choices, default=State.LAUNCHING)
    pid = models.PositiveIntegerField(null=True, blank=True)
    port = models.PositiveIntegerField(null=True, blank=True)
    socket_path = models.CharField(
        max_length=255, blank=True, help_text="the Unix socket it listens on, on its host"
    )
    launch_key = models.CharField(max_length=128)
    key = models.CharField(
        max_length=100, blank=True, help_text="the host's name for this engine process"
    )
    claim_bytes = models.BigIntegerField(
        null=True, blank=True, help_text="GPU memory per GPU it was launched to use"
    )
    gpu_indices = models.JSONField(default=list, blank=True)
    log_path = models.CharField(max_length=1024, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    started_at = models.DateTimeField(auto_now_add=True)
    ended_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at"]
        constraints = [
            # At most one live engine process per deployment.
            models.UniqueConstraint(
                fields=["deployment"],
                condition=~models.Q(state="exited"),
                name="instance_one_live_per_deployment",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.deployment.name}@{self.host.name}:{self.socket_path or self.port}"
