"""Budgets: ceilings on tokens, GPU-seconds and spend per key, user or team, per period.

The rule, one for every request: **every budget that applies to it must have room** (its
key's, its user's and, when the key is charged to a team, its team's). A budget has room
while what was used of it, with what requests in flight reserved of it, is under its
ceiling; so a request is refused once the used and reserved reach it, and one admitted
just before may pass it by at most its own reservation.

Periods are calendar periods in ``CAPYCTL_TIME_ZONE``: a day from midnight, a week from
Monday, a month from its first day; ``total`` never resets. What was used is the sum of
the :class:`~capyctl.access.models.Usage` rows since the period began, the one record
that reports read too: nothing to reset when a period ends.

Validation lives here once, for the CLI, REST and the admin.
"""

from __future__ import annotations

import math
import time
import zoneinfo
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Sum

from capyctl.access.models import ApiKey, Budget, Team, Usage
from capyctl.access.services import get_api_key, get_team, get_user
from capyctl.errors import UserError
from capyctl.events.services import record_event

MAX_TOKENS = 10**15
MAX_GPU_SECONDS = 10**12
MAX_SPEND = 10**12
QUARTER = 15 * 60  # seconds in a usage row's span
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)  # before any usage: where ``total`` counts from
_PERIOD_WORDS = {"day": "daily", "week": "weekly", "month": "monthly", "total": "total"}


def clock() -> float:
    """Now, as ``time.time()``: what periods are reckoned from (tests set it)."""
    return time.time()


def zone() -> zoneinfo.ZoneInfo:
    return zoneinfo.ZoneInfo(str(settings.CAPYCTL["TIME_ZONE"]))


def period_bounds(period: str, now: float | None = None) -> tuple[datetime, datetime | None]:
    """The current ``period``'s start and end (UTC; no end for ``total``)."""
    if period == "total":
        return _EPOCH, None
    here = datetime.fromtimestamp(clock() if now is None else now, zone())
    # fold=0: where midnight comes twice (a clock turned back at 01:00), its first.
    start = here.replace(hour=0, minute=0, second=0, microsecond=0, fold=0)
    if period == "week":
        start -= timedelta(days=start.weekday())
    elif period == "month":
        start = start.replace(day=1)
    if period == "day":
        end = _wall(start, days=1)
    elif period == "week":
        end = _wall(start, days=7)
    else:
        end = start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)
    return start.astimezone(UTC), end.astimezone(UTC)


def _wall(start: datetime, *, days: int) -> datetime:
    """``days`` calendar days after ``start``, at the same wall time (23 or 25 hours
    across a change of clocks)."""
    later = start.replace(tzinfo=None) + timedelta(days=days)
    return later.replace(tzinfo=start.tzinfo)


def quarter_of(now: float) -> datetime:
    """The start of the quarter hour ``now`` falls in: the usage row it adds to."""
    return datetime.fromtimestamp(now - now % QUARTER, UTC)


@dataclass(frozen=True)
class Used:
    tokens: int = 0
    gpu_seconds: float = 0.0
    spend: float = 0.0


# What a budget of each scope sums: the usage rows of its key, its user's keys, its team.
_SCOPE_FIELD = {"key": "key_id", "user": "key__user_id", "team": "team_id"}


def scope_of(budget: Budget) -> tuple[str, int]:
    """``("key", pk)``, ``("user", id)`` or ``("team", id)``."""
    if budget.key_id is not None:
        return "key", budget.key_id
    if budget.user_id is not None:
        return "user", budget.user_id
    return "team", int(budget.team_id or 0)


def used_of(budget: Budget, now: float | None = None) -> Used:
    """What was used of ``budget`` in its current period, as the database has it."""
    return used_of_many([budget], now)[budget.pk]


def used_of_many(found: list[Budget], now: float | None = None) -> dict[int, Used]:
    """What was used of each budget in its current period, by its id: one query for each
    scope and period among them, however many budgets."""
    groups: dict[tuple[str, str], list[Budget]] = {}
    for budget in found:
        groups.setdefault((scope_of(budget)[0], budget.period), []).append(budget)
    used: dict[int, Used] = {}
    for (scope, period), members in groups.items():
        start, _ = period_bounds(period, now)
        field = _SCOPE_FIELD[scope]
        ids = {scope_of(budget)[1] for budget in members}
        sums = {
            row[field]: Used(
                tokens=int(row["prompt"] or 0) + int(row["completion"] or 0),
                gpu_seconds=float(row["gpu"] or 0.0) + float(row["switch"] or 0.0),
                spend=float(row["spend"] or 0.0),
            )
            for row in Usage.objects.filter(**{f"{field}__in": ids}, at__gte=start)
            .values(field)
            .annotate(
                prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"),
                gpu=Sum("gpu_seconds"), switch=Sum("switch_gpu_seconds"), spend=Sum("spend"),
            )
            .order_by()
        }  # fmt: skip
        for budget in members:
            used[budget.pk] = sums.get(scope_of(budget)[1], Used())
    return used


def whose(budget: Budget) -> str:
    """Whose budget it is, in words: ``team ml``, ``user ana``, ``key capy_m8x6ps774i``."""
    if budget.key is not None:
        return f"key {budget.key.prefix}"
    if budget.user is not None:
        return f"user {budget.user.get_username()}"
    assert budget.team is not None  # noqa: S101 - the check constraint: one of the three
    return f"team {budget.team.name}"


def describe(budget: Budget) -> str:
    """``team ml's daily budget``."""
    return f"{whose(budget)}'s {_PERIOD_WORDS[budget.period]} budget"


def _check_limit(value: float | None, most: float, flag: str) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value <= 0 or value > most:
        raise UserError(f"{flag} must be a number above 0 and at most {most:,.0f}", field=flag)


def check_budget(
    *, scopes: int, tokens: int | None, gpu_seconds: float | None, period: str,
    soft_percent: int | None, spend: float | None = None,
) -> None:  # fmt: skip
    """A budget's values, checked (the CLI's, REST's and the admin's)."""
    if scopes != 1:
        raise UserError("name one of --key, --user or --team", field="scope")
    if period not in Budget.PERIODS:
        raise UserError(f"--period must be one of {', '.join(Budget.PERIODS)}", field="period")
    if tokens is None and gpu_seconds is None and spend is None:
        raise UserError("give --tokens, --gpu-seconds, --spend or more of them", field="tokens")
    _check_limit(tokens, MAX_TOKENS, "--tokens")
    _check_limit(gpu_seconds, MAX_GPU_SECONDS, "--gpu-seconds")
    _check_limit(spend, MAX_SPEND, "--spend")
    if soft_percent is not None and not 1 <= soft_percent <= 100:
        raise UserError("--soft must be a percentage from 1 to 100", field="soft_percent")


@transaction.atomic
def set_budget(
    *,
    key: str | None = None,
    user: str | None = None,
    team: str | None = None,
    tokens: int | None = None,
    gpu_seconds: float | None = None,
    spend: float | None = None,
    period: str,
    soft_percent: int | None = None,
    actor: str = "",
) -> tuple[Budget, bool]:
    """Set the ``period`` budget of one key, user or team: made, or (one of that scope and
    period exists) changed to these ceilings. Returns it and whether it was made."""
    check_budget(
        scopes=sum(x is not None for x in (key, user, team)), tokens=tokens,
        gpu_seconds=gpu_seconds, period=period, soft_percent=soft_percent, spend=spend,
    )  # fmt: skip
    scope: dict[str, ApiKey | Team | object] = {}
    if key is not None:
        scope["key"] = get_api_key(key)
    elif user is not None:
        scope["user"] = get_user(user)
    else:
        scope["team"] = get_team(str(team))
    budget = Budget.objects.select_for_update().filter(period=period, **scope).first()
    made = budget is None
    if budget is None:
        budget = Budget(period=period, **scope)
    budget.tokens = tokens
    budget.gpu_seconds = gpu_seconds
    budget.spend = spend
    budget.soft_percent = soft_percent
    budget.save()
    record_event("budget.set", f"{describe(budget)}: {limits_text(budget)}",
                 subject=whose(budget), actor=actor)  # fmt: skip
    return budget, made


def limits_text(budget: Budget) -> str:
    parts = []
    if budget.tokens is not None:
        parts.append(f"{budget.tokens:,} tokens")
    if budget.gpu_seconds is not None:
        parts.append(f"{budget.gpu_seconds:,g} GPU-seconds")
    if budget.spend is not None:
        parts.append(f"{budget.spend:,.2f} to spend")
    text = " and ".join(parts)
    if budget.soft_percent is not None:
        text += f" (soft line {budget.soft_percent}%)"
    return text


def get_budget(ident: str | int) -> Budget:
    try:
        pk = int(ident)
    except (TypeError, ValueError):
        raise UserError(f"a budget's id is a number, not {str(ident)[:32]!r}") from None
    budget = Budget.objects.select_related("key", "user", "team").filter(pk=pk).first()
    if budget is None:
        raise UserError(f"no budget {pk}")
    return budget


def remove_budget(ident: str | int, *, actor: str = "") -> None:
    budget = get_budget(ident)
    said = describe(budget)
    budget.delete()
    record_event("budget.removed", f"{said} removed", subject=said, actor=actor)


def budgets(
    *, key: str | None = None, user: str | None = None, team: str | None = None
) -> list[Budget]:
    """Every budget, or those of one key, user or team."""
    found = Budget.objects.select_related("key", "user", "team")
    if key is not None:
        found = found.filter(key=get_api_key(key))
    if user is not None:
        found = found.filter(user=get_user(user))
    if team is not None:
        found = found.filter(team=get_team(team))
    return list(found.order_by("pk"))


def budget_rows(found: list[Budget], now: float | None = None) -> list[dict[str, object]]:
    """:func:`budget_row` of each, their sums read together."""
    used = used_of_many(found, now)
    return [budget_row(budget, now, used=used[budget.pk]) for budget in found]


def budget_row(
    budget: Budget, now: float | None = None, *, used: Used | None = None
) -> dict[str, object]:
    """A budget as the CLI's ``--json``, REST and the usage page show it: its ceilings,
    what was used of them this period, and when the period ends."""
    used = used_of(budget, now) if used is None else used
    _, ends = period_bounds(budget.period, now)
    return {
        "id": budget.pk,
        "scope": "key" if budget.key_id else "user" if budget.user_id else "team",
        "of": whose(budget).split(" ", 1)[1],
        "period": budget.period,
        "tokens": budget.tokens,
        "gpu_seconds": budget.gpu_seconds,
        "spend": budget.spend,
        "soft_percent": budget.soft_percent,
        "used_tokens": used.tokens,
        "used_gpu_seconds": round(used.gpu_seconds, 3),
        "used_spend": round(used.spend, 6),
        "resets_at": None if ends is None else ends.astimezone(zone()).isoformat(),
    }
