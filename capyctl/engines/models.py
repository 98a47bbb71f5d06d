"""Inference server programs installed on hosts."""

from __future__ import annotations

from django.db import models

from hostagent.kinds import kind_names


class Engine(models.Model):
    """An engine program people installed, registered with ``capyctl engine add``.

    ``kind`` says how CapyCTL builds its command line, checks health, parks, wakes and
    stops it (see :mod:`hostagent.kinds`). ``command`` is the program (for ``custom``: a
    template with ``{port}`` and friends); it is split with shlex, never run by a shell.
    ``host`` empty means the same command works on every host.
    """

    name = models.CharField(max_length=63, unique=True)
    kind = models.CharField(max_length=32, choices=[(k, k) for k in kind_names()])
    command = models.TextField()
    host = models.ForeignKey(
        "hosts.Host", null=True, blank=True, on_delete=models.PROTECT, related_name="engines"
    )
    env = models.JSONField(default=dict, blank=True, help_text="extra environment variables")
    options = models.JSONField(
        default=dict, blank=True, help_text="kind-specific settings (health path, hooks…)"
    )
    # A park of this engine answered but left its GPU memory held: since then its models
    # are stopped rather than parked, until a park check (at an idle moment, not before
    # ``park_check_after``) frees memory again.
    park_unverified_at = models.DateTimeField(null=True, blank=True, editable=False)
    park_unverified_reason = models.TextField(blank=True, editable=False)
    park_check_after = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name
