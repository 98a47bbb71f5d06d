"""What each ``/v1`` request came to, for replaying the traffic (docs/what-if.md)."""

from __future__ import annotations

from django.db import models


class RequestTrace(models.Model):
    """One ``/v1`` request's metadata: when it came, for which model and key, how it was
    answered and how long each part took. Never its body, nor the answer's.

    Only requests that named a model their key may use are traced (a name from outside is
    neither trusted nor bounded). ``key_pk`` is the API key's numeric id, not a foreign
    key: a trace outlives its key. The gateway writes rows in batches, once a second
    (:mod:`capyctl.traces.recording`), and the oldest go past ``CAPYCTL_TRACE_MAX_ROWS``.
    """

    at = models.DateTimeField(db_index=True, help_text="when the request arrived")
    model = models.CharField(max_length=63, help_text="the deployment it was routed to")
    key_pk = models.PositiveBigIntegerField(help_text="the API key's numeric id")
    stream = models.BooleanField(help_text='whether the body asked "stream": true')
    status = models.PositiveSmallIntegerField(help_text="the HTTP status answered (499: left)")
    code = models.CharField(max_length=64, blank=True, help_text="the error's code, if one")
    queued_ms = models.PositiveIntegerField(help_text="time waiting for a start or wake")
    ttfb_ms = models.PositiveIntegerField(null=True, blank=True, help_text="until the head")
    duration_ms = models.PositiveIntegerField(help_text="arrival to the answer's end")
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    switch = models.TextField(blank=True, help_text="what its wake switched (x-capyctl-switch)")

    class Meta:
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.model} {self.status}"
