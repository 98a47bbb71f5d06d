"""API keys for ``/v1`` and REST automation."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

from capyctl.access.classes import CLASSES, INTERACTIVE

CLASS_CHOICES = [(c, c) for c in CLASSES]


class Team(models.Model):
    """People who share GPUs, and what their keys are charged to: a key may be charged to
    one team of its user (``ApiKey.team``). Only staff make teams and choose members."""

    name = models.CharField(max_length=63, unique=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, blank=True, related_name="teams")
    priority_class = models.CharField(
        max_length=12, choices=CLASS_CHOICES, default=INTERACTIVE,
        help_text="its keys' class, unless a key has its own (batch: idle GPUs only)",
    )  # fmt: skip
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ApiKey(models.Model):
    """A user's API key, ``capy_<key_id>_<secret>``.

    Only an HMAC-SHA256 of the secret is kept (keyed by a server secret), so a database
    leak gives no usable keys; the full key is shown once, when it is made. With
    ``limit_models`` off the key may use every deployment; on, only ``allowed_models``, so
    removing them all leaves it none (never every one). ``is_admin`` adds the REST
    automation scope.
    """

    key_id = models.CharField(max_length=16, unique=True)
    secret_hmac = models.CharField(max_length=64)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys"
    )
    name = models.CharField(max_length=100, blank=True)
    limit_models = models.BooleanField(
        default=False, help_text="only the models below (none left: no model)"
    )
    allowed_models = models.ManyToManyField(
        "deployments.Deployment", blank=True, related_name="api_keys"
    )
    allowed_adapters = models.ManyToManyField(
        "deployments.Adapter", blank=True, related_name="api_keys",
        help_text="adapters it may use (with limit_models on): one does not allow its base",
    )  # fmt: skip
    team = models.ForeignKey(
        Team, null=True, blank=True, on_delete=models.PROTECT, related_name="api_keys",
        help_text="the team it is charged to: one of its user's (empty: none)",
    )  # fmt: skip
    priority_class = models.CharField(
        max_length=12, choices=CLASS_CHOICES, blank=True, default="",
        help_text="interactive or batch (empty: its team's, else interactive)",
    )  # fmt: skip
    is_admin = models.BooleanField(default=False, help_text="may use the REST API as admin")
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    max_concurrent = models.PositiveIntegerField(
        null=True, blank=True, help_text="requests it may have in flight at once"
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    request_count = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.prefix} ({self.name or 'unnamed'})"

    @property
    def prefix(self) -> str:
        """The public part of the key, safe to show anywhere."""
        return f"capy_{self.key_id}"

    @property
    def effective_class(self) -> str:
        """Its own class, else its team's, else interactive (the team read: a query unless
        selected with the key)."""
        if self.priority_class:
            return self.priority_class
        return self.team.priority_class if self.team_id is not None else INTERACTIVE  # type: ignore[union-attr]

    def is_active(self, now: object = None) -> bool:
        moment = now or timezone.now()
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > moment  # type: ignore[operator]


class UserLimits(models.Model):
    """Ceilings that staff set for a user. Each of the user's keys can only narrow them,
    and the gateway applies them to every key at request time, so narrowing a user
    narrows the keys they already have. The rate and concurrency ceilings count the
    user's keys together. No row, or a field left empty, means no ceiling; for models,
    ``models_limited`` off means every model (on with none chosen means none)."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="limits"
    )
    models_limited = models.BooleanField(
        default=False, help_text="only the models chosen below (none chosen: no model)"
    )
    allowed_models = models.ManyToManyField(
        "deployments.Deployment", blank=True, related_name="user_limits"
    )
    allowed_adapters = models.ManyToManyField(
        "deployments.Adapter", blank=True, related_name="user_limits"
    )
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="across all of the user's keys"
    )
    max_concurrent = models.PositiveIntegerField(
        null=True, blank=True, help_text="requests in flight at once, across all their keys"
    )
    key_lifetime = models.DurationField(
        null=True, blank=True, help_text="longest a key may live, from when it is made"
    )

    class Meta:
        verbose_name = "user limits"
        verbose_name_plural = "user limits"

    def __str__(self) -> str:
        return f"limits of {self.user}"

    @staticmethod
    def ceilings(limits: UserLimits | None) -> Ceilings:
        """What a user's row of limits binds them to (no row: nothing)."""
        if limits is None:
            return Ceilings()
        return Ceilings(
            models=frozenset(
                [
                    *(d.name for d in limits.allowed_models.all()),
                    *(a.name for a in limits.allowed_adapters.all()),
                ]
            )
            if limits.models_limited
            else None,
            requests_per_minute=limits.requests_per_minute,
            max_concurrent=limits.max_concurrent,
            key_lifetime=limits.key_lifetime,
        )


@dataclass(frozen=True)
class Ceilings:
    """A user's ceilings (None: no ceiling). ``models``: the names they may use."""

    models: frozenset[str] | None = None
    requests_per_minute: int | None = None
    max_concurrent: int | None = None
    key_lifetime: timedelta | None = None


class Budget(models.Model):
    """A ceiling on what one key, one user (all their keys) or one team (the keys charged to
    it) may use in a period: tokens (prompt and completion), GPU-seconds, spend (what those
    come to at the models' prices), or any of them. Every
    budget that applies to a request must have room for it (:mod:`capyctl.access.budgets`).
    What was used is not kept here: it is the sum of :class:`Usage` since the period began,
    the one record that reports read too."""

    PERIODS = ("day", "week", "month", "total")

    key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.CASCADE,
                            related_name="budgets")  # fmt: skip
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                             on_delete=models.CASCADE, related_name="budgets")  # fmt: skip
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.CASCADE,
                             related_name="budgets")  # fmt: skip
    tokens = models.BigIntegerField(null=True, blank=True, help_text="prompt + completion")
    gpu_seconds = models.FloatField(null=True, blank=True)
    spend = models.FloatField(
        null=True, blank=True, help_text="in the currency of the models' prices"
    )
    period = models.CharField(max_length=8, choices=[(p, p) for p in PERIODS])
    soft_percent = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="an event (and the alert webhook) once a period when "
        "this much of it is used",
    )  # fmt: skip
    # The start of the last period whose soft line was crossed (said once a period).
    soft_alerted_for = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["pk"]
        constraints = [
            models.CheckConstraint(
                name="budget_one_scope",
                condition=(
                    models.Q(key__isnull=False, user__isnull=True, team__isnull=True)
                    | models.Q(key__isnull=True, user__isnull=False, team__isnull=True)
                    | models.Q(key__isnull=True, user__isnull=True, team__isnull=False)
                ),
            ),
            models.CheckConstraint(
                name="budget_has_a_limit",
                condition=models.Q(tokens__isnull=False)
                | models.Q(gpu_seconds__isnull=False)
                | models.Q(spend__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"budget {self.pk}"


class Usage(models.Model):
    """What one key used of one model in a quarter of an hour (UTC; every time zone's day
    begins on a quarter hour), and the team it was charged to then: the record budgets
    are counted from and usage reports read. Written off the request path, about once a
    second, by adding to the row (two processes may each make a row for the same cell:
    everything that reads usage sums it)."""

    at = models.DateTimeField(help_text="the start of its quarter hour")
    key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="usage")
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.SET_NULL,
                             related_name="usage")  # fmt: skip
    model = models.CharField(max_length=128)
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    # The time its requests held their engines times its GPUs, shared among the requests
    # in flight together, and their shares of the switches made for them.
    gpu_seconds = models.FloatField(default=0.0)
    switch_gpu_seconds = models.FloatField(default=0.0)
    # What its tokens and GPU-seconds came to at its model's prices when it ran.
    spend = models.FloatField(default=0.0)

    class Meta:
        indexes = [
            models.Index(fields=["at"]),
            models.Index(fields=["key", "at"]),
            models.Index(fields=["team", "at"]),
        ]

    def __str__(self) -> str:
        return f"usage of {self.key_id} on {self.model} at {self.at:%Y-%m-%d %H:%M}"
