"""Inference server programs installed on hosts."""

from __future__ import annotations

from django.db import models

from hostagent.kinds import get_kind, kind_names
from hostagent.versions import EngineFeatures


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
    # What the program said of itself (its --version, and its --help's flags where its kind
    # reads one), at `engine add` where the command runs there, then at each host's first
    # launch of it. Empty ``version`` with ``version_note``: why it is not known yet.
    version = models.CharField(max_length=100, blank=True, editable=False)
    flags = models.JSONField(null=True, blank=True, editable=False)
    version_note = models.CharField(max_length=300, blank=True, editable=False)
    version_checked_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def features(self) -> EngineFeatures | None:
        """What the program last said of itself, or None if it was never read."""
        if not self.version and self.flags is None:
            return None
        flags = frozenset(self.flags) if isinstance(self.flags, list) else None
        probes = get_kind(self.kind).probes
        shown = " ".join(probes.help) if probes is not None and probes.help else ""
        return EngineFeatures(
            version=self.version, flags=flags, help_command=shown, note=self.version_note
        )

    @property
    def version_shown(self) -> str:
        """The version, or why it is not known."""
        return self.version or self.version_note or "unknown"
