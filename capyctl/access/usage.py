"""Usage reports: what was used since a moment, by team, user, key or model, summed from
the :class:`~capyctl.access.models.Usage` rows the gateway writes (one a key, team, model
and quarter hour). The CLI (``capyctl usage``), REST (``/api/usage/``) and the usage page
read the same function, so they cannot disagree."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import Q, QuerySet, Sum
from django.db.models.functions import Coalesce

from capyctl.access.budgets import quarter_of
from capyctl.access.models import Usage
from capyctl.errors import UserError

BY = ("team", "user", "key", "model")
_GROUP = {"team": "team__name", "user": "key__user__username", "key": "key__key_id",
          "model": "model"}  # fmt: skip


def _rows(since: datetime, user_id: int | None) -> QuerySet[Usage]:
    rows = Usage.objects.filter(at__gte=quarter_of(since.timestamp()))
    if user_id is not None:  # a user's own keys, and the teams they are in
        seen = rows.filter(Q(key__user_id=user_id) | Q(team__members__id=user_id))
        rows = Usage.objects.filter(pk__in=seen.values("pk"))
    return rows


def usage_by(by: str, since: datetime, *, user_id: int | None = None) -> list[dict[str, Any]]:
    """One row for each team, user, key or model, the most tokens first: requests, tokens,
    GPU-seconds (the switches' shares in them, and apart) from the quarter hour of ``since``.
    ``user_id``: only what that user may see (their keys, their teams)."""
    if by not in BY:
        raise UserError(f"--by must be one of {', '.join(BY)}", field="by")
    group = _GROUP[by]
    rows = _rows(since, user_id)
    sums = (
        rows.values(group)
        .annotate(
            requests_=Coalesce(Sum("requests"), 0),
            prompt=Coalesce(Sum("prompt_tokens"), 0),
            completion=Coalesce(Sum("completion_tokens"), 0),
            gpu=Coalesce(Sum("gpu_seconds"), 0.0),
            switch=Coalesce(Sum("switch_gpu_seconds"), 0.0),
            spend=Coalesce(Sum("spend"), 0.0),
        )
        .order_by()
    )
    out = [
        {
            by: row[group],  # None: the keys charged to no team
            "requests": int(row["requests_"]),
            "prompt_tokens": int(row["prompt"]),
            "completion_tokens": int(row["completion"]),
            "tokens": int(row["prompt"]) + int(row["completion"]),
            "gpu_seconds": round(float(row["gpu"]) + float(row["switch"]), 3),
            "switch_gpu_seconds": round(float(row["switch"]), 3),
            "spend": round(float(row["spend"]), 6),
        }
        for row in sums
    ]
    return sorted(out, key=lambda r: (-r["tokens"], -r["gpu_seconds"], str(r[by] or "")))
