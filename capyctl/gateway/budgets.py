"""Budgets at the gateway: every budget that applies to a request must have room for it
(:mod:`capyctl.access.budgets` states the rule), checked and reserved in one step.

On admission a request reserves its worst case against each budget that applies (its
key's, its user's, its team's): tokens, its prompt (a token a 4 bytes of body, at
least) plus what it may generate (``max_tokens`` or its kin, times ``n``; else the
model's ceiling on ``max_tokens``; else 1,024); GPU-seconds, twice what a request of that
model cost lately (else 1 GPU-second a GPU it holds). A budget has room while what was
used with what is reserved is under its ceiling, so fifty requests at once against a
budget with room for ten are let in until the reservations fill it: it is passed by at
most one reservation. When the request ends its reservation is settled to what it used.

The counts: in this process (standalone), or atomically in Redis (server mode), one hash
a budget and period, begun from the database's sum of usage when Redis has none. While
Redis does not answer, each API process counts alone from the database's sum, as the
rate limits do: a budget then holds per process, and may be passed by as many
reservations as there are processes.

A budget's soft line crossed is said once a period: a ``budget.soft_crossed`` event and,
with ``CAPYCTL_ALERT_WEBHOOK`` set, a POST to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from django.conf import settings
from django.db import connection

from capyctl.access import budgets as rules
from capyctl.access.models import Budget
from capyctl.events.services import record_event
from capyctl.gateway.batches import one_line
from capyctl.gateway.errors import GatewayError
from capyctl.gateway.keys import KeyInfo
from capyctl.gateway.routing import Route
from capyctl.scheduler import gateway_api as scheduler

logger = logging.getLogger("capyctl.gateway")

REFRESH_SECONDS = 1.0  # budgets set or removed take effect within about this
DEFAULT_COMPLETION = 1024  # tokens reserved for a request that bounds none
_BYTES_A_TOKEN = 4
_COMPLETION_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
RETRY_CAP_SECONDS = 3600
_WEBHOOK_SECONDS = 5.0


@dataclass(frozen=True)
class BudgetLine:
    """A budget as the gateway checks it; ``seed``: what the database had used of it in
    the current period, at the last refresh."""

    pk: int
    scope: tuple[str, int]  # ("key", pk), ("user", id) or ("team", id)
    period: str
    tokens: int | None
    gpu_seconds: float | None
    soft_percent: int | None
    words: str  # "team ml's daily budget"
    seed: rules.Used = field(default_factory=rules.Used)
    seed_start: float = 0.0  # the start of the period the seed is of

    def seed_for(self, start: float) -> rules.Used:
        """What to begin a period's count with: the seed if it is of that period; nothing
        for a period begun since (its usage is yet to come)."""
        return self.seed if start == self.seed_start else rules.Used()


@dataclass
class Reservation:
    """What one request reserved, and of which budgets (in which period each)."""

    lines: list[tuple[BudgetLine, float]]  # each budget, with its period's start
    tokens: float
    gpu_seconds: float
    local: bool = False  # counted in this process (Redis did not answer)


def _counter_key(line: BudgetLine, start: float) -> str:
    return f"capyctl:budget:{line.pk}:{int(start)}"


class LocalCounts:
    """Used and reserved, per budget and period, in this process."""

    def __init__(self) -> None:
        # (pk, period start) -> [used tokens, used GPU-s, reserved tokens, reserved GPU-s]
        self._counts: dict[tuple[int, float], list[float]] = {}

    def _of(self, line: BudgetLine, start: float) -> list[float]:
        counts = self._counts.get((line.pk, start))
        if counts is None:
            for old in [k for k in self._counts if k[0] == line.pk]:  # an ended period's
                del self._counts[old]
            counts = self._counts[(line.pk, start)] = [
                float(line.seed.tokens),
                line.seed.gpu_seconds,
                0.0,
                0.0,
            ]
        return counts

    def reserve(
        self, lines: list[tuple[BudgetLine, float]], tokens: float, gpu: float
    ) -> tuple[int, str, float, float] | None:
        """Reserve in every budget, or, when one has no room, in none: then its index,
        which ceiling (``tokens`` or ``gpu``), and its used and reserved."""
        for at, (line, start) in enumerate(lines):
            used_t, used_g, res_t, res_g = self._of(line, start)
            if line.tokens is not None and used_t + res_t >= line.tokens:
                return at, "tokens", used_t, res_t
            if line.gpu_seconds is not None and used_g + res_g >= line.gpu_seconds:
                return at, "gpu", used_g, res_g
        for line, start in lines:
            counts = self._of(line, start)
            counts[2] += tokens
            counts[3] += gpu
        return None

    def settle(
        self, reservation: Reservation, tokens: float, gpu: float
    ) -> list[tuple[float, float]]:
        """Swap the reservation for what was used; returns each budget's used after."""
        after = []
        for line, start in reservation.lines:
            counts = self._counts.get((line.pk, start))
            if counts is None:  # its period ended meanwhile: nothing to settle there
                after.append((0.0, 0.0))
                continue
            counts[0] += tokens
            counts[1] += gpu
            counts[2] = max(counts[2] - reservation.tokens, 0.0)
            counts[3] = max(counts[3] - reservation.gpu_seconds, 0.0)
            after.append((counts[0], counts[1]))
        return after


# Every budget is checked before any is reserved in, so a request refused by one reserves
# in none. ARGV: five a budget (seed tokens, seed GPU-s, ceiling tokens and GPU-s, -1 for
# none, seconds to keep it), then the reservation's tokens and GPU-s.
_RESERVE_SCRIPT = """
local n = #KEYS
local need_t = tonumber(ARGV[5 * n + 1])
local need_g = tonumber(ARGV[5 * n + 2])
for i, key in ipairs(KEYS) do
  local b = (i - 1) * 5
  if redis.call('EXISTS', key) == 0 then
    redis.call('HSET', key, 'ut', ARGV[b + 1], 'ug', ARGV[b + 2], 'rt', 0, 'rg', 0)
  end
  redis.call('EXPIRE', key, tonumber(ARGV[b + 5]))
  local v = redis.call('HMGET', key, 'ut', 'ug', 'rt', 'rg')
  local lt = tonumber(ARGV[b + 3])
  local lg = tonumber(ARGV[b + 4])
  if lt >= 0 and tonumber(v[1]) + tonumber(v[3]) >= lt then return {i, 'tokens', v[1], v[3]} end
  if lg >= 0 and tonumber(v[2]) + tonumber(v[4]) >= lg then return {i, 'gpu', v[2], v[4]} end
end
for i, key in ipairs(KEYS) do
  redis.call('HINCRBYFLOAT', key, 'rt', need_t)
  redis.call('HINCRBYFLOAT', key, 'rg', need_g)
end
return false
"""

# ARGV: the reservation's tokens and GPU-s, then what was used of each. Returns each
# budget's used tokens and GPU-s after ('-1' where Redis no longer has the budget).
_SETTLE_SCRIPT = """
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    local rt = tonumber(redis.call('HINCRBYFLOAT', key, 'rt', -tonumber(ARGV[1])))
    local rg = tonumber(redis.call('HINCRBYFLOAT', key, 'rg', -tonumber(ARGV[2])))
    if rt < 0 then redis.call('HSET', key, 'rt', 0) end
    if rg < 0 then redis.call('HSET', key, 'rg', 0) end
    out[2 * i - 1] = redis.call('HINCRBYFLOAT', key, 'ut', ARGV[3])
    out[2 * i] = redis.call('HINCRBYFLOAT', key, 'ug', ARGV[4])
  else
    out[2 * i - 1] = '-1'
    out[2 * i] = '-1'
  end
end
return out
"""


# What this process counted alone while Redis did not answer, given back once it does:
# ARGV four a budget (used tokens and GPU-s to add, reserved ones to take back). A budget
# Redis no longer has is begun again from the database, whose usage rows hold it already.
_OWED_SCRIPT = """
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    local b = (i - 1) * 4
    redis.call('HINCRBYFLOAT', key, 'ut', ARGV[b + 1])
    redis.call('HINCRBYFLOAT', key, 'ug', ARGV[b + 2])
    if tonumber(redis.call('HINCRBYFLOAT', key, 'rt', -tonumber(ARGV[b + 3]))) < 0 then
      redis.call('HSET', key, 'rt', 0)
    end
    if tonumber(redis.call('HINCRBYFLOAT', key, 'rg', -tonumber(ARGV[b + 4]))) < 0 then
      redis.call('HSET', key, 'rg', 0)
    end
  end
end
return #KEYS
"""


class RedisCounts:
    """The same counts in Redis, shared by every API process; this process's own while
    Redis does not answer (see the module's docstring). What it counted alone meanwhile
    (the usage of requests it let in, and the reservations made in Redis that it could
    not take back) is given back to Redis once it answers again."""

    def __init__(self, url: str) -> None:
        self._redis = scheduler.redis_async_client(url)
        self._reserve = self._redis.register_script(_RESERVE_SCRIPT)
        self._settle = self._redis.register_script(_SETTLE_SCRIPT)
        self._give_back = self._redis.register_script(_OWED_SCRIPT)
        self._errors = scheduler.redis_errors()
        self._link = scheduler.redis_link(url)
        self.local = LocalCounts()
        # Redis key -> [used tokens, used GPU-s, reserved tokens, reserved GPU-s] owed
        self._owed: dict[str, list[float]] = {}

    def _owe(self, reservation: Reservation, tokens: float, gpu: float) -> None:
        held = 0.0 if reservation.local else 1.0  # reserved in Redis: take it back too
        for line, start in reservation.lines:
            owed = self._owed.setdefault(_counter_key(line, start), [0.0, 0.0, 0.0, 0.0])
            owed[0] += tokens
            owed[1] += gpu
            owed[2] += held * reservation.tokens
            owed[3] += held * reservation.gpu_seconds

    async def _pay_back(self) -> None:
        owed, self._owed = self._owed, {}
        try:
            await self._give_back(keys=list(owed), args=[v for row in owed.values() for v in row])
        except self._errors as exc:
            self._link.failed(exc)
            for key, row in owed.items():  # kept for the next time it answers
                mine = self._owed.setdefault(key, [0.0, 0.0, 0.0, 0.0])
                for at, value in enumerate(row):
                    mine[at] += value

    async def reserve(
        self, lines: list[tuple[BudgetLine, float]], tokens: float, gpu: float
    ) -> tuple[tuple[int, str, float, float] | None, bool]:
        """:meth:`LocalCounts.reserve`'s answer, and whether it was counted here alone."""
        if self._owed and self._link.answers():
            await self._pay_back()
        if self._link.answers():
            args: list[Any] = []
            for line, start in lines:
                _, ends = rules.period_bounds(line.period)
                keep = 30 * 86400 if ends is None else int(ends.timestamp() - start) + 86400
                seed = line.seed_for(start)
                args += [seed.tokens, seed.gpu_seconds,
                         -1 if line.tokens is None else line.tokens,
                         -1 if line.gpu_seconds is None else line.gpu_seconds, keep]  # fmt: skip
            try:
                refused = await self._reserve(
                    keys=[_counter_key(line, start) for line, start in lines],
                    args=[*args, tokens, gpu],
                )
            except self._errors as exc:
                self._link.failed(exc)
            else:
                if not refused:
                    return None, False
                at, which, used, held = refused
                return (int(at) - 1, _text(which), float(used), float(held)), False
        return self.local.reserve(lines, tokens, gpu), True

    async def settle(
        self, reservation: Reservation, tokens: float, gpu: float
    ) -> list[tuple[float, float]]:
        if reservation.local or not self._link.answers():
            self._owe(reservation, tokens, gpu)
            return self.local.settle(reservation, tokens, gpu)
        try:
            out = await self._settle(
                keys=[_counter_key(line, start) for line, start in reservation.lines],
                args=[reservation.tokens, reservation.gpu_seconds, tokens, gpu],
            )
        except self._errors as exc:
            self._link.failed(exc)
            self._owe(reservation, tokens, gpu)
            return self.local.settle(reservation, tokens, gpu)
        values = [float(_text(v)) for v in out]
        return [(values[i], values[i + 1]) for i in range(0, len(values), 2)]

    async def close(self) -> None:
        await self._redis.aclose()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _load() -> dict[tuple[str, int], list[BudgetLine]]:
    """Every budget, by what it applies to, with what its period used so far."""
    table: dict[tuple[str, int], list[BudgetLine]] = {}
    try:
        now = rules.clock()
        for budget in Budget.objects.select_related("key", "user", "team"):
            scope = (
                ("key", budget.key_id) if budget.key_id is not None
                else ("user", budget.user_id) if budget.user_id is not None
                else ("team", int(budget.team_id or 0))
            )  # fmt: skip
            table.setdefault(scope, []).append(
                BudgetLine(
                    pk=budget.pk, scope=scope, period=budget.period, tokens=budget.tokens,
                    gpu_seconds=budget.gpu_seconds, soft_percent=budget.soft_percent,
                    words=rules.describe(budget), seed=rules.used_of(budget, now),
                    seed_start=rules.period_bounds(budget.period, now)[0].timestamp(),
                )
            )  # fmt: skip
        return table
    finally:
        connection.close()


class Budgets:
    """The gateway's budgets: what applies to a key, and the counts that hold them."""

    def __init__(self, redis_url: str | None) -> None:
        self.counts: LocalCounts | RedisCounts = (
            RedisCounts(redis_url) if redis_url else LocalCounts()
        )
        self._table: dict[tuple[str, int], list[BudgetLine]] | None = None
        self._read_at = 0.0
        self._reading: asyncio.Task[None] | None = None
        self._alerted: set[tuple[int, float]] = set()  # soft lines said, by this process
        self._tasks: set[asyncio.Task[Any]] = set()

    async def _refresh(self) -> None:
        try:
            self._table = await asyncio.to_thread(_load)
            self._read_at = time.monotonic()
        except Exception as exc:  # the last table read stands; the next request tries again
            logger.warning("could not read the budgets: %s", one_line(exc))
            if self._table is None:
                raise

    async def _lines(self, key: KeyInfo) -> list[BudgetLine]:
        if self._table is None:
            await self._refresh()
        elif time.monotonic() - self._read_at > REFRESH_SECONDS and (
            self._reading is None or self._reading.done()
        ):
            self._reading = asyncio.ensure_future(self._refresh())
        table = self._table or {}
        if not table:
            return []
        lines = [*table.get(("key", key.pk), ()), *table.get(("user", key.user_id), ())]
        if key.team_id is not None:
            lines += table.get(("team", key.team_id), ())
        return lines

    async def admit(
        self, key: KeyInfo, route: Route, parsed: dict[str, Any] | None, body_bytes: int,
        typical_gpu_seconds: float | None,
    ) -> Reservation | None:  # fmt: skip
        """Reserve the request's worst case in every budget that applies to it (None when
        none does); 429 ``budget_exceeded`` when one has no room."""
        lines = await self._lines(key)
        if not lines:
            return None
        now = rules.clock()
        spans = [(line, rules.period_bounds(line.period, now)) for line in lines]
        held = [(line, start.timestamp()) for line, (start, _) in spans]
        tokens = float(_worst_tokens(parsed, body_bytes, route))
        gpus = max(len(route.gpus), 1)
        gpu = 2 * typical_gpu_seconds if typical_gpu_seconds else float(gpus)
        if isinstance(self.counts, RedisCounts):
            refused, local = await self.counts.reserve(held, tokens, gpu)
        else:
            refused, local = self.counts.reserve(held, tokens, gpu), True
        if refused is not None:
            line, (_, ends) = spans[refused[0]]
            raise _exceeded(line, refused, ends, now)
        return Reservation(held, tokens, gpu, local=local)

    async def settle(self, reservation: Reservation, tokens: int, gpu_seconds: float) -> None:
        """The request ended having used ``tokens`` and ``gpu_seconds``."""
        if isinstance(self.counts, RedisCounts):
            after = await self.counts.settle(reservation, tokens, gpu_seconds)
        else:
            after = self.counts.settle(reservation, tokens, gpu_seconds)
        for (line, start), (used_t, used_g) in zip(reservation.lines, after, strict=True):
            if line.soft_percent is None or (line.pk, start) in self._alerted:
                continue
            share = line.soft_percent / 100
            crossed = (line.tokens is not None and used_t >= share * line.tokens) or (
                line.gpu_seconds is not None and used_g >= share * line.gpu_seconds
            )
            if crossed:
                self._alerted.add((line.pk, start))
                task = asyncio.ensure_future(
                    asyncio.to_thread(_soft_crossed, line, start, used_t, used_g)
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._reading is not None:
            with contextlib.suppress(Exception):
                await self._reading
        if isinstance(self.counts, RedisCounts):
            await self.counts.close()


def _worst_tokens(parsed: dict[str, Any] | None, body_bytes: int, route: Route) -> int:
    prompt = max(body_bytes // _BYTES_A_TOKEN, 1)
    completion: int | None = None
    if parsed is not None:
        for name in _COMPLETION_FIELDS:
            value = parsed.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                completion = value
                break
    if completion is None:
        ceiling = dict(route.ceilings).get("max_tokens")
        completion = ceiling or DEFAULT_COMPLETION
    n = parsed.get("n") if parsed is not None else None
    many = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    return prompt + completion * many


def _amount(which: str, value: float) -> str:
    if which == "tokens":
        return f"{math.ceil(value):,}"
    return f"{value:,.1f}"


def _exceeded(
    line: BudgetLine, refused: tuple[int, str, float, float], ends: datetime | None, now: float
) -> GatewayError:
    _, which, used, reserved = refused
    most = line.tokens if which == "tokens" else line.gpu_seconds
    ceiling = float(most or 0)
    unit = "tokens" if which == "tokens" else "GPU-seconds"
    limit = _amount(which, ceiling)
    if used < ceiling:  # requests in flight hold the rest: room comes back as they end
        message = (
            f"{line.words[0].upper()}{line.words[1:]} is held by requests in flight: "
            f"{_amount(which, used)} of {limit} {unit} used and {_amount(which, reserved)} "
            "reserved; retry when they end."
        )
        wait = 1
    elif ends is None:
        message = (
            f"{line.words[0].upper()}{line.words[1:]} is used up: {_amount(which, used)} of "
            f"{limit} {unit}; it does not reset."
        )
        wait = RETRY_CAP_SECONDS
    else:
        local = ends.astimezone(rules.zone())
        message = (
            f"{line.words[0].upper()}{line.words[1:]} is used up: {_amount(which, used)} of "
            f"{limit} {unit}; it resets at {local:%Y-%m-%d %H:%M} "
            f"{settings.CAPYCTL['TIME_ZONE']}."
        )
        wait = min(max(math.ceil(ends.timestamp() - now), 1), RETRY_CAP_SECONDS)
    return GatewayError(
        429, "budget_exceeded", message, "rate_limit_error",
        headers=[(b"retry-after", str(wait).encode())],
    )  # fmt: skip


def _soft_crossed(line: BudgetLine, start: float, used_t: float, used_g: float) -> None:
    """Say once a period (across processes: a conditional update) that ``line``'s soft
    line was crossed: an event, and a POST to the alert webhook when one is set."""
    try:
        period = datetime.fromtimestamp(start, UTC)
        won = (
            Budget.objects.filter(pk=line.pk)
            .exclude(soft_alerted_for=period)
            .update(soft_alerted_for=period)
        )
        if not won:
            return
        parts = []
        if line.tokens is not None:
            parts.append(f"{_amount('tokens', used_t)} of {line.tokens:,} tokens")
        if line.gpu_seconds is not None:
            parts.append(f"{used_g:,.1f} of {line.gpu_seconds:,g} GPU-seconds")
        said = f"{line.words} passed its soft line ({line.soft_percent}%): {', '.join(parts)}"
        record_event("budget.soft_crossed", said, subject=line.words, level="warning",
                     data={"budget": line.pk, "used_tokens": used_t,
                           "used_gpu_seconds": used_g})  # fmt: skip
        url = settings.CAPYCTL["ALERT_WEBHOOK"]
        if url:
            payload = {
                "event": "budget.soft_crossed", "budget": line.pk, "of": line.words,
                "period": line.period, "period_start": period.isoformat(),
                "soft_percent": line.soft_percent, "tokens": line.tokens,
                "gpu_seconds": line.gpu_seconds, "used_tokens": used_t,
                "used_gpu_seconds": used_g, "message": said,
            }  # fmt: skip
            try:
                httpx.post(str(url), json=payload, timeout=_WEBHOOK_SECONDS)
            except httpx.HTTPError as exc:  # the event stands; the URL is never logged
                logger.warning("the alert webhook did not take budget %d's alert: %s",
                               line.pk, type(exc).__name__)  # fmt: skip
    except Exception as exc:
        logger.warning("could not say budget %d's soft line: %s", line.pk, one_line(exc))
    finally:
        connection.close()
