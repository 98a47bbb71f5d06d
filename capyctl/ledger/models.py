"""The memory ledger: what each deployment holds or was promised in each pool."""

from __future__ import annotations

from django.db import models


class LedgerEntry(models.Model):
    """Bytes one deployment holds or was promised in one pool of one host.

    ``status``: ``held`` (measured, in use), ``promised`` (admitted for a start or wake
    that is under way), ``unconfirmed`` (should have been released but the probe has not
    shown it free yet — still counts as used), ``foreign`` (used by processes CapyCTL did
    not start; then ``deployment`` is empty). Admission keeps, per pool,
    held + promised + unconfirmed + foreign + need ≤ capacity.
    """

    class Status(models.TextChoices):
        HELD = "held"
        PROMISED = "promised"
        UNCONFIRMED = "unconfirmed"
        FOREIGN = "foreign"

    host = models.ForeignKey("hosts.Host", on_delete=models.CASCADE, related_name="ledger")
    pool = models.CharField(max_length=16, help_text="gpu0, gpu1…, ram or unified")
    deployment = models.ForeignKey(
        "deployments.Deployment",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="ledger_entries",
    )
    bytes = models.BigIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices)
    note = models.CharField(max_length=255, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["host", "pool", "deployment"]
        verbose_name_plural = "ledger entries"
        constraints = [
            models.UniqueConstraint(
                fields=["host", "pool", "deployment"],
                condition=models.Q(deployment__isnull=False),
                name="ledger_one_entry_per_deployment_pool",
            ),
            models.UniqueConstraint(
                fields=["host", "pool"],
                condition=models.Q(deployment__isnull=True),
                name="ledger_one_foreign_entry_per_pool",
            ),
            models.CheckConstraint(condition=models.Q(bytes__gte=0), name="ledger_bytes_gte_0"),
        ]

    def __str__(self) -> str:
        who = self.deployment.name if self.deployment is not None else "foreign"
        return f"{self.host.name}/{self.pool}: {who} {self.status} {self.bytes}"
