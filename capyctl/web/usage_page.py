"""``/usage/``: what was used, day by day, by team; the top keys; the budgets and how much
of each is used. Staff see everything; a user sees their own keys, the teams they are in
and the budgets that apply to them.

The charts are SVG drawn here from the usage record (:class:`capyctl.access.models.Usage`,
the rows budgets and ``capyctl usage`` sum): stacked bars of tokens and of GPU-seconds a
day (days of ``CAPYCTL_TIME_ZONE``), one colour a team. No script, nothing fetched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth.decorators import login_required
from django.db.models import Q, Sum
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe
from django.views.decorators.http import require_GET

from capyctl.access import budgets as rules
from capyctl.access.models import Budget, Usage
from capyctl.access.usage import usage_by

DAYS = (7, 14, 30, 90)
# Distinct for the eye and in greyscale; teams past the last share its colour.
PALETTE = ("#2f6fb0", "#e0883a", "#3a9a5b", "#b04a7a", "#7d5fb2", "#8c8c2b", "#4aa3b0", "#777")
NO_TEAM = "(no team)"
WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 720, 220, 56, 28, 10


@dataclass
class Series:
    name: str
    colour: str
    values: list[float]  # one a day


def _visible(user: Any) -> Q:
    """The usage rows ``user`` may see: all for staff; else their keys' and their teams'."""
    if user.is_staff:
        return Q()
    return Q(key__user_id=user.pk) | Q(team__members__id=user.pk)


def daily(user: Any, days: int, now: float | None = None) -> tuple[list[str], list[Series],
                                                                    list[Series]]:  # fmt: skip
    """The last ``days`` days (of the configured zone), and for each team its tokens and
    its GPU-seconds on each of them."""
    zone = rules.zone()
    today, _ = rules.period_bounds("day", now)
    starts = [(today.astimezone(zone) - timedelta(days=n)).replace(hour=0, minute=0)
              for n in range(days - 1, -1, -1)]  # fmt: skip
    labels = [f"{s:%m-%d}" for s in starts]
    seen = Usage.objects.filter(_visible(user), at__gte=starts[0])
    if not user.is_staff:
        seen = Usage.objects.filter(pk__in=seen.values("pk"))
    rows = seen.values("at", "team__name").annotate(
        prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"),
        held=Sum("gpu_seconds"), switch=Sum("switch_gpu_seconds"),
    )  # fmt: skip
    tokens: dict[str, list[float]] = {}
    gpu: dict[str, list[float]] = {}
    for row in rows:
        at: datetime = row["at"].astimezone(zone)
        day = (at.date() - starts[0].date()).days
        if not 0 <= day < days:
            continue
        team = row["team__name"] or NO_TEAM
        tokens.setdefault(team, [0.0] * days)[day] += (row["prompt"] or 0) + (
            row["completion"] or 0
        )
        gpu.setdefault(team, [0.0] * days)[day] += (row["held"] or 0) + (row["switch"] or 0)
    names = sorted(tokens, key=lambda t: (t == NO_TEAM, -sum(tokens[t]), t))
    colours = {name: PALETTE[min(at, len(PALETTE) - 1)] for at, name in enumerate(names)}
    return (
        labels,
        [Series(n, colours[n], tokens[n]) for n in names],
        [Series(n, colours[n], gpu[n]) for n in names],
    )


def _nice_top(most: float) -> float:
    """A round ceiling for the axis: 1, 2 or 5 times a power of ten, at least ``most``."""
    if most <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(most))
    for step in (1, 2, 5, 10):
        if step * power >= most:
            return float(step * power)
    return float(10 * power)


def _amount(value: float) -> str:
    if value >= 1_000_000:
        return f"{value / 1_000_000:g}M"
    if value >= 1000:
        return f"{value / 1000:g}k"
    return f"{value:g}"


def stacked_bars(title: str, unit: str, labels: list[str], series: list[Series]) -> SafeString:
    """An SVG of one stacked bar a day, a colour a series, with its axis and a title on
    each piece (what it is, shown on hover)."""
    days = len(labels)
    totals = [sum(s.values[d] for s in series) for d in range(days)]
    top = _nice_top(max(totals, default=0.0))
    plot_w, plot_h = WIDTH - LEFT - 8, HEIGHT - BOTTOM - TOP
    slot = plot_w / max(days, 1)
    bar = max(slot * 0.7, 1.0)
    head = (f'<svg class="chart" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" '
            f'data-chart="{escape(unit)}" aria-label="{escape(title)}">')  # fmt: skip
    out = [head]
    for tick in range(5):
        value = top * tick / 4
        y = TOP + plot_h - plot_h * tick / 4
        out.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - 8}" y1="{y:.1f}" y2="{y:.1f}"/>')
        out.append(f'<text class="axis" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                   f"{_amount(value)}</text>")  # fmt: skip
    every = max(1, math.ceil(days / 10))
    for day, label in enumerate(labels):
        x = LEFT + slot * day + (slot - bar) / 2
        if (days - 1 - day) % every == 0:  # today, and evenly back from it
            out.append(f'<text class="axis" x="{x + bar / 2:.1f}" y="{HEIGHT - 8}" '
                       f'text-anchor="middle">{label}</text>')  # fmt: skip
        base = float(TOP + plot_h)
        for one in series:
            value = one.values[day]
            if value <= 0:
                continue
            height = plot_h * value / top
            base -= height
            what = f"{one.name}, {label}: {value:,.{0 if unit == 'tokens' else 1}f} {unit}"
            out.append(f'<rect class="bar" x="{x:.1f}" y="{base:.1f}" width="{bar:.1f}" '
                       f'height="{max(height, 0.5):.1f}" fill="{one.colour}" '
                       f'data-series="{escape(one.name)}" data-day="{label}" '
                       f'data-value="{value:.3f}"><title>{escape(what)}</title>'
                       "</rect>")  # fmt: skip
    out.append("</svg>")
    return mark_safe("".join(out))  # noqa: S308 - every text in it is escaped above


def budget_rows(user: Any) -> list[dict[str, Any]]:
    """The budgets ``user`` may see, with what each period used, as shares."""
    found = Budget.objects.select_related("key", "user", "team")
    if not user.is_staff:
        found = found.filter(Q(key__user_id=user.pk) | Q(user_id=user.pk)
                             | Q(team__members__id=user.pk)).distinct()  # fmt: skip
    rows = []
    chosen = list(found.order_by("pk"))
    for budget, row in zip(chosen, rules.budget_rows(chosen), strict=True):
        resets = row["resets_at"]
        row["resets"] = str(resets)[:16].replace("T", " ") if resets else "never"
        shares: list[tuple[str, float, float]] = []
        if budget.tokens:
            shares.append(("tokens", float(str(row["used_tokens"])), budget.tokens))
        if budget.gpu_seconds:
            shares.append(("GPU-seconds", float(str(row["used_gpu_seconds"])), budget.gpu_seconds))
        if budget.spend:
            shares.append(("spent", float(str(row["used_spend"])), budget.spend))
        row["bars"] = [
            {"unit": unit, "used": used, "of": most,
             "percent": min(round(100 * used / most), 100), "over": used >= most}
            for unit, used, most in shares
        ]  # fmt: skip
        rows.append(row)
    return rows


@require_GET
@login_required
def usage_page(request: HttpRequest) -> HttpResponse:
    try:
        days = int(request.GET.get("days", "14"))
    except ValueError:
        days = 14
    if days not in DAYS:
        days = 14
    user = request.user
    labels, tokens, gpu = daily(user, days)
    since = datetime.fromtimestamp(rules.clock(), rules.zone()) - timedelta(days=days)
    keys = usage_by("key", since, user_id=None if user.is_staff else user.pk)[:10]
    most = max((k["tokens"] for k in keys), default=0) or 1
    for key in keys:
        key["percent"] = round(100 * key["tokens"] / most)
    context = {
        "nav": "usage",
        "days": days,
        "day_choices": DAYS,
        "legend": tokens,
        "tokens_chart": stacked_bars("Tokens a day by team", "tokens", labels, tokens),
        "gpu_chart": stacked_bars("GPU-seconds a day by team", "GPU-seconds", labels, gpu),
        "keys": keys,
        "budgets": budget_rows(user),
        "zone": rules.zone().key,
    }
    return render(request, "web/usage.html", context)
