"""Requested operations: intents saved before they are carried out."""

from __future__ import annotations

from django.db import models


class Operation(models.Model):
    """An intent to start, stop, park or wake a deployment, saved first and then carried
    out by the process that owns the engines (standalone's server, or a worker). The
    requester waits on this row for the outcome."""

    class Action(models.TextChoices):
        START = "start"
        STOP = "stop"
        PARK = "park"
        WAKE = "wake"
        RESTART = "restart"

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    deployment = models.ForeignKey(
        "deployments.Deployment", on_delete=models.CASCADE, related_name="operations"
    )
    action = models.CharField(max_length=8, choices=Action.choices)
    mode = models.CharField(
        max_length=8, blank=True, help_text="park mode, if asked; a restart's: rolling"
    )
    actor = models.CharField(max_length=150, blank=True)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    message = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [models.Index(fields=["status", "created_at"])]

    def __str__(self) -> str:
        return f"{self.action} {self.deployment_id} ({self.status})"
