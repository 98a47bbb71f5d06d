"""Budgets at the gateway: every budget that applies to a request must have room for it
(:mod:`capyctl.access.budgets` states the rule), checked and reserved in one step.

On admission a request reserves its worst case against each budget that applies (its
key's, its user's, its team's): tokens, its prompt (a token a 4 bytes of body, at
least) plus what it may generate (``max_tokens`` or its kin, times ``n``; else the
model's ceiling on ``max_tokens``); GPU-seconds, twice what a request of that
model cost lately (else 1 GPU-second a GPU it holds); spend, those at the model's prices.
A budget has room while what was
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
import uuid
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
DEFAULT_COMPLETION = 1024  # tokens reserved where nothing bounds a request (no ceiling read)
_BYTES_A_TOKEN = 4
_COMPLETION_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
RETRY_CAP_SECONDS = 3600
_WEBHOOK_SECONDS = 5.0


# What a budget bounds, in this order everywhere: a request's need, a budget's ceilings,
# its counts (used, then reserved).
MEASURES = ("tokens", "gpu_seconds", "spend")
UNITS = ("tokens", "GPU-seconds", "to spend")
Amounts = tuple[float, float, float]
NONE: Amounts = (0.0, 0.0, 0.0)


@dataclass(frozen=True)
class BudgetLine:
    """A budget as the gateway checks it: its ceilings (None: not bounded); ``seed``:
    what the database had used of it in the current period, at the last refresh."""

    pk: int
    scope: tuple[str, int]  # ("key", pk), ("user", id) or ("team", id)
    period: str
    ceilings: tuple[float | None, float | None, float | None]
    soft_percent: int | None
    words: str  # "team ml's daily budget"
    seed: Amounts = NONE
    seed_start: float = 0.0  # the start of the period the seed is of

    def seed_for(self, start: float) -> Amounts:
        """What to begin a period's count with: the seed if it is of that period; nothing
        for a period begun since (its usage is yet to come)."""
        return self.seed if start == self.seed_start else NONE

    def full(self, used: Amounts, reserved: Amounts) -> int | None:
        """The first measure whose used and reserved reach its ceiling (None: room)."""
        for at, most in enumerate(self.ceilings):
            if most is not None and used[at] + reserved[at] >= most:
                return at
        return None


@dataclass
class Reservation:
    """What one request reserved, and of which budgets (in which period each)."""

    lines: list[tuple[BudgetLine, float]]  # each budget, with its period's start
    need: Amounts
    local: bool = False  # counted in this process (Redis did not answer)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)  # its id in Redis


# A budget with no room: its index, the measure, and that measure's used and reserved.
Refusal = tuple[int, int, float, float]


def _counter_key(line: BudgetLine, start: float) -> str:
    return f"capyctl:budget:{line.pk}:{int(start)}"


class LocalCounts:
    """Used and reserved, per budget and period, in this process."""

    def __init__(self) -> None:
        # (pk, period start) -> [used of each measure..., reserved of each measure...]
        self._counts: dict[tuple[int, float], list[float]] = {}

    def _of(self, line: BudgetLine, start: float) -> list[float]:
        counts = self._counts.get((line.pk, start))
        if counts is None:
            for old in [k for k in self._counts if k[0] == line.pk]:  # an ended period's
                del self._counts[old]
            counts = self._counts[(line.pk, start)] = [*line.seed_for(start), *NONE]
        return counts

    def reserve(self, lines: list[tuple[BudgetLine, float]], need: Amounts) -> Refusal | None:
        """Reserve in every budget, or, when one has no room, in none: then which."""
        for at, (line, start) in enumerate(lines):
            counts = self._of(line, start)
            full = line.full((counts[0], counts[1], counts[2]), (counts[3], counts[4], counts[5]))
            if full is not None:
                return at, full, counts[full], counts[3 + full]
        for line, start in lines:
            counts = self._of(line, start)
            for at in range(3):
                counts[3 + at] += need[at]
        return None

    def settle(self, reservation: Reservation, used: Amounts) -> list[Amounts]:
        """Swap the reservation for what was used; returns each budget's used after."""
        after: list[Amounts] = []
        for line, start in reservation.lines:
            counts = self._counts.get((line.pk, start))
            if counts is None:  # its period ended meanwhile: nothing to settle there
                after.append(NONE)
                continue
            for at in range(3):
                counts[at] += used[at]
                if reservation.local:  # held here (not in Redis): taken back here
                    counts[3 + at] = max(counts[3 + at] - reservation.need[at], 0.0)
            after.append((counts[0], counts[1], counts[2]))
        return after


# Every budget is checked before any is reserved in, so a request refused by one reserves
# in none. A hash a budget and period: u1..u3 used, r1..r3 reserved of each measure,
# ``born`` (Redis's clock when it was begun), and ``h:ID`` for each reservation it holds.
# ARGV: seven a budget (its seed of each measure, its ceiling of each, -1 for none, and
# the seconds to keep it), then the reservation of each measure, then its id.
_RESERVE_SCRIPT = """
local n = #KEYS
local now = redis.call('TIME')
for i, key in ipairs(KEYS) do
  local b = (i - 1) * 7
  if redis.call('EXISTS', key) == 0 then
    redis.call('HSET', key, 'u1', ARGV[b + 1], 'u2', ARGV[b + 2], 'u3', ARGV[b + 3],
               'r1', 0, 'r2', 0, 'r3', 0, 'born', string.format('%d.%06d', now[1], now[2]))
  end
  redis.call('EXPIRE', key, tonumber(ARGV[b + 7]))
  for m = 1, 3 do
    local most = tonumber(ARGV[b + 3 + m])
    if most >= 0 then
      local used = redis.call('HGET', key, 'u' .. m)
      local held = redis.call('HGET', key, 'r' .. m)
      if tonumber(used) + tonumber(held) >= most then return {i, m, used, held} end
    end
  end
end
for i, key in ipairs(KEYS) do
  for m = 1, 3 do
    redis.call('HINCRBYFLOAT', key, 'r' .. m, ARGV[7 * n + m])
  end
  redis.call('HSET', key, 'h:' .. ARGV[7 * n + 4], 1)
end
return false
"""

# A reservation settled (or given back after an outage), once: the last KEY marks it
# settled for an hour, so a settle that timed out after it ran and is given back later
# counts nothing twice. Each budget: its hold taken back if it still holds it; the usage
# added if it held it, or if the hash was begun before the usage was counted (one begun
# since, from the database's sum, counts it already). ARGV: the reservation's id, its
# need of each measure, the used of each, and when the usage was counted (time.time()).
# Returns each budget's used of each measure after ('-1' where Redis has no budget).
_SETTLE_SCRIPT = """
local n = #KEYS - 1
local done = KEYS[#KEYS]
local out = {}
local again = redis.call('EXISTS', done) == 1
for i = 1, n do
  local key = KEYS[i]
  for m = 1, 3 do out[3 * (i - 1) + m] = '-1' end
  if redis.call('EXISTS', key) == 1 then
    if not again then
      local held = redis.call('HDEL', key, 'h:' .. ARGV[1]) == 1
      local born = tonumber(redis.call('HGET', key, 'born') or '0')
      local counts = held or born <= tonumber(ARGV[8])
      for m = 1, 3 do
        if held then
          if tonumber(redis.call('HINCRBYFLOAT', key, 'r' .. m, -tonumber(ARGV[1 + m]))) < 0 then
            redis.call('HSET', key, 'r' .. m, 0)
          end
        end
        if counts then redis.call('HINCRBYFLOAT', key, 'u' .. m, ARGV[4 + m]) end
      end
    end
    for m = 1, 3 do out[3 * (i - 1) + m] = redis.call('HGET', key, 'u' .. m) end
  end
end
redis.call('SET', done, 1, 'EX', 3600)
return out
"""


class RedisCounts:
    """The same counts in Redis, shared by every API process; this process's own while
    Redis does not answer (see the module's docstring). A reservation this process could
    not settle in Redis (it did not answer) is settled there once it answers again: its
    hold taken back, what it used added, each once; the counts kept here meanwhile are
    then dropped, so a later outage begins again from the database's sum."""

    def __init__(self, url: str) -> None:
        self._redis = scheduler.redis_async_client(url)
        self._reserve = self._redis.register_script(_RESERVE_SCRIPT)
        self._settle = self._redis.register_script(_SETTLE_SCRIPT)
        self._errors = scheduler.redis_errors()
        self._link = scheduler.redis_link(url)
        self.local = LocalCounts()
        self._alone = False  # it counted here alone since Redis last answered
        # Settles Redis did not take: (reservation, used, when it was counted)
        self._owed: list[tuple[Reservation, Amounts, float]] = []

    async def _settle_there(
        self, reservation: Reservation, used: Amounts, counted_at: float
    ) -> list[Amounts]:
        keys = [_counter_key(line, start) for line, start in reservation.lines]
        out = await self._settle(
            keys=[*keys, f"capyctl:budget:settled:{reservation.rid}"],
            args=[reservation.rid, *reservation.need, *used, counted_at],
        )
        values = [float(_text(v)) for v in out]
        return [(values[i], values[i + 1], values[i + 2]) for i in range(0, len(values), 3)]

    async def _pay_back(self) -> None:
        owed, self._owed = self._owed, []
        for at, (reservation, used, counted_at) in enumerate(owed):
            try:
                await self._settle_there(reservation, used, counted_at)
            except self._errors as exc:
                self._link.failed(exc)
                self._owed.extend(owed[at:])  # kept for the next time it answers
                return
        self.local, self._alone = LocalCounts(), False  # Redis holds it all again

    async def reserve(
        self, lines: list[tuple[BudgetLine, float]], need: Amounts, rid: str
    ) -> tuple[Refusal | None, bool]:
        """:meth:`LocalCounts.reserve`'s answer, and whether it was counted here alone."""
        if self._owed and self._link.answers():
            await self._pay_back()
        if self._link.answers():
            args: list[Any] = []
            for line, start in lines:
                _, ends = rules.period_bounds(line.period)
                keep = 30 * 86400 if ends is None else int(ends.timestamp() - start) + 86400
                ceilings = [-1 if most is None else most for most in line.ceilings]
                args += [*line.seed_for(start), *ceilings, keep]
            try:
                refused = await self._reserve(
                    keys=[_counter_key(line, start) for line, start in lines],
                    args=[*args, *need, rid],
                )
            except self._errors as exc:  # it may have run: its settle takes the hold back
                self._link.failed(exc)
            else:
                if self._alone and not self._owed:  # back: what was counted here goes
                    self.local, self._alone = LocalCounts(), False
                if not refused:
                    return None, False
                at, measure, used, held = refused
                return (
                    int(at) - 1,
                    int(measure) - 1,
                    float(_text(used)),
                    float(_text(held)),
                ), False
        self._alone = True
        return self.local.reserve(lines, need), True

    async def settle(self, reservation: Reservation, used: Amounts) -> list[Amounts]:
        now = time.time()
        if not self._link.answers():
            self._owed.append((reservation, used, now))
            return self.local.settle(reservation, used)
        if self._owed:
            await self._pay_back()
        try:
            return await self._settle_there(reservation, used, now)
        except self._errors as exc:  # it may have run: given back, it counts nothing twice
            self._link.failed(exc)
            self._owed.append((reservation, used, now))
            return self.local.settle(reservation, used)

    async def close(self) -> None:
        await self._redis.aclose()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _load() -> dict[tuple[str, int], list[BudgetLine]]:
    """Every budget, by what it applies to, with what its period used so far."""
    table: dict[tuple[str, int], list[BudgetLine]] = {}
    try:
        now = rules.clock()
        found = list(Budget.objects.select_related("key", "user", "team"))
        all_used = rules.used_of_many(found, now)  # a query a scope and period, no more
        for budget in found:
            used, scope = all_used[budget.pk], rules.scope_of(budget)
            table.setdefault(scope, []).append(
                BudgetLine(
                    pk=budget.pk, scope=scope, period=budget.period,
                    ceilings=(budget.tokens, budget.gpu_seconds, budget.spend),
                    soft_percent=budget.soft_percent, words=rules.describe(budget),
                    seed=(used.tokens, used.gpu_seconds, used.spend),
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
        prompt, completion = _worst_tokens(parsed, body_bytes, route)
        gpus = max(len(route.gpus), 1)
        gpu = 2 * typical_gpu_seconds if typical_gpu_seconds else float(gpus)
        need = (float(prompt + completion), gpu, spend_of(route.prices, prompt, completion, gpu))
        rid = uuid.uuid4().hex
        if isinstance(self.counts, RedisCounts):
            refused, local = await self.counts.reserve(held, need, rid)
        else:
            refused, local = self.counts.reserve(held, need), True
        if refused is not None:
            line, (_, ends) = spans[refused[0]]
            raise _exceeded(line, refused, ends, now)
        return Reservation(held, need, local=local, rid=rid)

    async def settle(self, reservation: Reservation, used: Amounts) -> None:
        """The request ended having used ``used`` (tokens, GPU-seconds, spend)."""
        if isinstance(self.counts, RedisCounts):
            after = await self.counts.settle(reservation, used)
        else:
            after = self.counts.settle(reservation, used)
        for (line, start), now_used in zip(reservation.lines, after, strict=True):
            if line.soft_percent is None or (line.pk, start) in self._alerted:
                continue
            share = line.soft_percent / 100
            crossed = any(
                most is not None and now_used[at] >= share * most
                for at, most in enumerate(line.ceilings)
            )
            if crossed:
                self._alerted.add((line.pk, start))
                task = asyncio.ensure_future(
                    asyncio.to_thread(_soft_crossed, line, start, now_used)
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


def spend_of(prices: Amounts, prompt: float, completion: float, gpu_seconds: float) -> float:
    """What tokens and GPU-seconds come to at a model's prices (a million prompt tokens, a
    million completion tokens, a GPU-hour)."""
    return (prompt * prices[0] + completion * prices[1]) / 1e6 + gpu_seconds * prices[2] / 3600


def _worst_tokens(parsed: dict[str, Any] | None, body_bytes: int, route: Route) -> tuple[int, int]:
    """The most a request may use: its prompt, and what it may generate."""
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
    return prompt, completion * many


def _amount(measure: int, value: float) -> str:
    if measure == 0:  # tokens
        return f"{math.ceil(value):,}"
    return f"{value:,.1f}" if measure == 1 else f"{value:,.2f}"


def _of(measure: int, used: float, most: float) -> str:
    """``1,050 of 1,000 tokens``, ``12.5 of 10 GPU-seconds``, ``5.20 of 5.00 to spend``."""
    return f"{_amount(measure, used)} of {_amount(measure, most)} {UNITS[measure]}"


def _exceeded(
    line: BudgetLine, refused: Refusal, ends: datetime | None, now: float
) -> GatewayError:
    _, measure, used, reserved = refused
    ceiling = float(line.ceilings[measure] or 0)
    whose = f"{line.words[0].upper()}{line.words[1:]}"
    if used < ceiling:  # requests in flight hold the rest: room comes back as they end
        message = (
            f"{whose} is held by requests in flight: {_of(measure, used, ceiling)} used and "
            f"{_amount(measure, reserved)} reserved; retry when they end."
        )
        wait = 1
    elif ends is None:
        message = f"{whose} is used up: {_of(measure, used, ceiling)}; it does not reset."
        wait = RETRY_CAP_SECONDS
    else:
        local = ends.astimezone(rules.zone())
        message = (
            f"{whose} is used up: {_of(measure, used, ceiling)}; it resets at "
            f"{local:%Y-%m-%d %H:%M} {settings.CAPYCTL['TIME_ZONE']}."
        )
        wait = min(max(math.ceil(ends.timestamp() - now), 1), RETRY_CAP_SECONDS)
    return GatewayError(
        429, "budget_exceeded", message, "rate_limit_error",
        headers=[(b"retry-after", str(wait).encode())],
    )  # fmt: skip


def _soft_crossed(line: BudgetLine, start: float, used: Amounts) -> None:
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
        parts = [
            _of(at, used[at], most) for at, most in enumerate(line.ceilings) if most is not None
        ]
        said = f"{line.words} passed its soft line ({line.soft_percent}%): {', '.join(parts)}"
        figures = {f"used_{name}": used[at] for at, name in enumerate(MEASURES)}
        record_event("budget.soft_crossed", said, subject=line.words, level="warning",
                     data={"budget": line.pk, **figures})  # fmt: skip
        url = settings.CAPYCTL["ALERT_WEBHOOK"]
        if url:
            payload = {
                "event": "budget.soft_crossed", "budget": line.pk, "of": line.words,
                "period": line.period, "period_start": period.isoformat(),
                "soft_percent": line.soft_percent,
                **dict(zip(MEASURES, line.ceilings, strict=True)), **figures, "message": said,
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
