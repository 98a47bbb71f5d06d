"""What happened, when, and why: the record behind ``capyctl events`` and the dashboard."""

from __future__ import annotations

from django.db import models


class Event(models.Model):
    """One thing that happened: a transition, a park, a key issued, a setting changed.

    ``kind`` is a dotted verb (``deployment.added``, ``deployment.parked``, ``key.revoked``);
    ``subject`` keeps the name of what it was about even after that row is deleted.
    ``duration_ms`` is set for timed steps (start, park, wake, switch).
    """

    class Level(models.TextChoices):
        INFO = "info"
        WARNING = "warning"
        ERROR = "error"

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    kind = models.CharField(max_length=64, db_index=True)
    level = models.CharField(max_length=8, choices=Level.choices, default=Level.INFO)
    subject = models.CharField(max_length=128, blank=True)
    message = models.TextField()
    deployment = models.ForeignKey(
        "deployments.Deployment",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="events",
    )
    host = models.ForeignKey(
        "hosts.Host", null=True, blank=True, on_delete=models.SET_NULL, related_name="events"
    )
    actor = models.CharField(max_length=150, blank=True, help_text="who asked: user or 'system'")
    duration_ms = models.PositiveIntegerField(null=True, blank=True)
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.kind} {self.subject}"
