"""API keys for ``/v1`` and REST automation."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class ApiKey(models.Model):
    """A user's API key, ``capy_<key_id>_<secret>``.

    Only an HMAC-SHA256 of the secret is kept (keyed by a server secret), so a database
    leak gives no usable keys; the full key is shown once, when it is made. ``allowed_models``
    empty means every deployment. ``is_admin`` adds the REST automation scope.
    """

    key_id = models.CharField(max_length=16, unique=True)
    secret_hmac = models.CharField(max_length=64)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys"
    )
    name = models.CharField(max_length=100, blank=True)
    allowed_models = models.ManyToManyField(
        "deployments.Deployment", blank=True, related_name="api_keys"
    )
    is_admin = models.BooleanField(default=False, help_text="may use the REST API as admin")
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
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

    def is_active(self, now: object = None) -> bool:
        moment = now or timezone.now()
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > moment  # type: ignore[operator]
