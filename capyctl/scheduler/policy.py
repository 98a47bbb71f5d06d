"""Placement and eviction policy: a pure function of plain data (no database, no clock).

``plan(snapshot, need)`` answers where a deployment can run and which ready deployments
must give memory back first, and how each of them should do it (the data it decides on
and answers is :mod:`capyctl.scheduler.placement_data`, whose names it offers too):

- Placement: a deployment without a host goes to a host where it fits; ``gpus: N`` takes
  N GPU pools of one host. Hosts and GPUs where it fits without evicting anyone come
  first (tightest fit first, so large free GPUs stay free for large models).
- Eviction, when it does not fit: only ``ready`` deployments that are not pinned, have
  been ready at least ``min_ready_seconds`` and hold memory on the chosen GPUs; lower
  priority first, then least recently used. The smallest set that frees enough is kept.
- Parked residuals: a park leaves some memory on the GPU (the engine's CUDA context and
  graphs: hundreds of MiB to GiBs). Where parking the ready models does not free enough
  because those residuals add up, parked models that are not pinned are stopped too
  (lower priority first, then least recently used), each with the reason; a wake never
  stops its own model. Stops of parked models are the first dropped from the set.
- Turns: a ready deployment that is busy (requests in flight, or one that ended a moment
  ago) keeps its memory while others wait, up to its ``max_turn_seconds`` of their wait;
  then the contender that has waited longest (each point of priority counts as
  :data:`TURN_PRIORITY_SECONDS` of waiting) goes next. A contender with another ahead of it
  on the same GPUs waits too, so switching is paid once per turn, not per request.
  Priority classes change both (:mod:`capyctl.scheduler.turn_rules`): a model only batch
  requests wait for never ends the turn of one serving interactive requests, and its
  wait counts for :data:`BATCH_SHARE` of its seconds.
- Park mode per victim (DESIGN §5): ``ram`` if its engine can and its weights copy fits
  in the RAM pool (never on unified memory, where the copy would come out of the pool it
  is meant to free); else ``deep`` if its engine can; else ``stop``.
- Replicas: a model's replicas are placed one at a time, each like a model of its own;
  ``Need.siblings`` names the others. A replica never goes on a GPU pool where a sibling
  holds memory, in any state (replicas are on distinct GPUs: on unified memory, one per
  host), and a sibling is never a victim for it. A replica does not wait for a sibling to
  leave: when only the siblings' GPUs could take it, the answer is a lasting
  ``NoCapacity`` that says so. With ``spread="hosts"`` a host with fewer siblings comes
  first among options that evict as much (as many victims, as many stops): spreading
  outranks tightness of fit (slack, evicted bytes), since a host lost or busy then takes
  fewer replicas with it, but never costs an eviction. ``spread="gpus"`` only asks for
  distinct GPUs and leaves the choice of host to fit alone.
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import combinations

from capyctl.scheduler.park_modes import expected_residual, gib, park_mode
from capyctl.scheduler.placement_data import (
    BATCH_SHARE,
    DEEP,
    MIN_RESIDUAL_BYTES,
    RAM,
    RESIDUAL_SHARE,
    SPREAD_GPUS,
    SPREAD_HOSTS,
    STOP,
    TURN_PRIORITY_SECONDS,
    Contender,
    HostSnapshot,
    Need,
    NoCapacity,
    Placement,
    Pool,
    Resident,
    Victim,
    is_gpu_pool,
    standing,
)
from capyctl.scheduler.turn_rules import (
    in_its_turn,
    room_kept_for,
    turn_before,
    turn_left,
    turn_left_for,
    turn_refusal,
)

__all__ = [
    "BATCH_SHARE",
    "DEEP",
    "MIN_RESIDUAL_BYTES",
    "RAM",
    "RESIDUAL_SHARE",
    "SPREAD_GPUS",
    "SPREAD_HOSTS",
    "STOP",
    "TURN_PRIORITY_SECONDS",
    "Contender",
    "HostSnapshot",
    "Need",
    "NoCapacity",
    "Placement",
    "Pool",
    "Resident",
    "Victim",
    "expected_residual",
    "is_gpu_pool",
    "park_mode",
    "plan",
    "room_kept_for",
    "standing",
    "turn_left",
    "turn_refusal",
]


def _evictable(resident: Resident, need: Need) -> bool:
    return (
        resident.deployment_id not in need.siblings
        and resident.state == "ready"
        and not resident.pinned
        and resident.ready_for_seconds >= resident.min_ready_seconds
        and not in_its_turn(resident, need)
    )


def _sibling_pools(host: HostSnapshot, need: Need) -> set[str]:
    """The GPU pools of ``host`` where another replica of ``need`` holds memory."""
    return {
        pool
        for r in host.residents
        if r.deployment_id in need.siblings
        for pool, held in r.gpu_bytes.items()
        if held > 0
    }


def _siblings_on(host: HostSnapshot, need: Need) -> int:
    """How many other replicas of ``need`` are on ``host``, in any state."""
    return len({r.deployment_id for r in host.residents if r.deployment_id in need.siblings})


def _frees(resident: Resident, mode: str) -> dict[str, int]:
    if mode == STOP:
        return dict(resident.gpu_bytes)
    return {
        pool: held - expected_residual(resident, held) for pool, held in resident.gpu_bytes.items()
    }


def _shortfall(host: HostSnapshot, pools: tuple[str, ...], need: Need) -> dict[str, int]:
    """Bytes missing per pool (only pools that lack something)."""
    missing = {}
    # On unified memory the engine process lives in the same pool as its GPU memory.
    per_pool = need.claim_per_gpu_bytes + (need.host_ram_bytes if host.unified else 0)
    for pool in pools:
        lack = per_pool - host.pools[pool].free_bytes
        if lack > 0:
            missing[pool] = lack
    ram_need = need.host_ram_bytes
    if host.unified:
        ram_need += need.claim_per_gpu_bytes if pools else 0
    ram_lack = (
        ram_need - host.pools[host.ram_pool].free_bytes
        if host.ram_pool in host.pools and not host.unified
        else 0
    )
    if ram_lack > 0:
        missing[host.ram_pool] = ram_lack
    return missing


def _try_victims(
    host: HostSnapshot, pools: tuple[str, ...], need: Need
) -> tuple[Victim, ...] | None:
    """The smallest set of victims that makes ``need`` fit on ``pools``, or None."""
    missing = _shortfall(host, pools, need)
    if not missing:
        return ()
    chosen: list[Victim] = []
    remaining = dict(missing)
    if host.ram_pool in missing and not host.unified:
        # Parking frees GPU memory, never host RAM; parked copies in host RAM do: the least
        # recently used are stopped (a sleeping engine cannot drop its copy otherwise).
        copies = _copies_to_drop(host, remaining, need)
        if copies is None:
            return None
        chosen = copies
    order = sorted(
        (r for r in host.residents if _evictable(r, need) and set(r.gpu_bytes) & set(missing)),
        key=lambda r: (r.priority, r.last_used),
    )
    ram_free = host.pools[host.ram_pool].free_bytes if host.ram_pool in host.pools else 0
    ram_free += sum(v.frees.get(host.ram_pool, 0) for v in chosen)
    for resident in order:
        if all(v <= 0 for v in remaining.values()):
            break
        mode, reason = park_mode(resident, host, ram_free)
        frees = _frees(resident, mode)
        copy = resident.weights_bytes if mode == RAM else 0
        if host.unified:
            # A unified pool gets back what the GPU gives minus any copy kept in it.
            frees = {pool: amount - copy for pool, amount in frees.items()}
        ram_free -= copy
        turn_over = resident.busy and resident.max_turn_seconds > 0
        chosen.append(Victim(resident.deployment_id, resident.name, mode, frees, copy, reason,
                             turn_over))  # fmt: skip
        for pool, amount in frees.items():
            if pool in remaining:
                remaining[pool] -= amount
    if any(v > 0 for v in remaining.values()):
        # Parking leaves each model's residual on its GPUs (its CUDA context, graphs);
        # where those add up to the shortfall, parked models are stopped too.
        chosen = _residuals_to_stop(host, remaining, need, chosen)
    if any(v > 0 for v in remaining.values()):
        return None
    # Keep the smallest set: drop victims that are not needed, parked models stopped for
    # their residuals first (a stop costs a start later), then the most valuable first.
    for victim in sorted(chosen, key=lambda v: (v.reason.startswith(_RESIDUAL_REASON),
                                                _value(host, v)), reverse=True):  # fmt: skip
        trial = [v for v in chosen if v is not victim]
        if _enough(trial, missing):
            chosen = trial
    return tuple(chosen)


def _copies_to_drop(
    host: HostSnapshot, remaining: dict[str, int], need: Need
) -> list[Victim] | None:
    """Parked models whose copies in host RAM, dropped, cover its shortfall (they are
    stopped: what they held comes back, RAM and GPU), least recently used first; None when
    all of them would not be enough. ``remaining`` is reduced by what they free. Other
    replicas of ``need`` keep theirs."""
    copies = sorted(
        (
            r
            for r in host.residents
            if r.state == "parked"
            and not r.pinned
            and r.ram_bytes > 0
            and r.deployment_id not in need.siblings
        ),
        key=lambda r: (r.priority, r.last_used),
    )
    chosen: list[Victim] = []
    for resident in copies:
        if remaining.get(host.ram_pool, 0) <= 0:
            break
        frees = {**resident.gpu_bytes, host.ram_pool: resident.ram_bytes}
        reason = f"its copy in host RAM ({gib(resident.ram_bytes)}) is needed for another engine"
        chosen.append(Victim(resident.deployment_id, resident.name, STOP, frees, 0, reason))
        for pool, amount in frees.items():
            if pool in remaining:
                remaining[pool] -= amount
    return chosen if remaining.get(host.ram_pool, 0) <= 0 else None


_RESIDUAL_REASON = "its parked residual"


def _stoppable_parked(resident: Resident, need: Need) -> bool:
    """Whether a parked model may be stopped to make room for ``need``: any that is not
    pinned, not another replica of it, and not itself (a wake's own residual stays)."""
    return (
        resident.state == "parked"
        and not resident.pinned
        and resident.deployment_id not in need.siblings
        and resident.deployment_id != need.deployment_id
    )


def _residuals_to_stop(
    host: HostSnapshot, remaining: dict[str, int], need: Need, victims: list[Victim]
) -> list[Victim]:
    """``victims`` and parked models that hold what is still missing on a GPU pool of
    ``remaining``, stopped to give it back: lower priority first, then least recently used,
    until nothing is missing there; where those are not enough (pinned ones stay), a
    victim that would leave a residual is stopped instead of parked. ``remaining`` is
    reduced by what they free."""
    taken = {v.deployment_id for v in victims}
    gpus = {pool for pool, lack in remaining.items() if lack > 0 and pool != host.ram_pool}
    if host.unified and remaining.get(host.ram_pool, 0) > 0:
        gpus.add(host.ram_pool)  # the one pool is the GPU's
    # Stops are for what would stay however long it waited: what parked models hold beyond
    # their residuals (not yet confirmed free) passes, and so does what the models that
    # may not be parked now (busy, in their turn, just ready, starting) would free once
    # they may.
    short = {pool: remaining[pool] - sum(_passing(r, pool) + _later(r, pool, need, taken)
                                         for r in host.residents)
             for pool in gpus}  # fmt: skip
    if all(lack <= 0 for lack in short.values()):
        return victims  # waiting is enough
    parked = sorted(
        (
            r
            for r in host.residents
            if r.deployment_id not in taken
            and _stoppable_parked(r, need)
            and any(r.gpu_bytes.get(pool, 0) > 0 for pool in gpus)
        ),
        key=lambda r: (r.priority, r.last_used),
    )
    chosen: list[Victim] = []
    for resident in parked:
        if all(lack <= 0 for lack in short.values()):
            break
        held = sum(resident.gpu_bytes.get(p, 0) - _passing(resident, p) for p in gpus)
        frees = dict(resident.gpu_bytes)
        if resident.ram_bytes > 0 and not host.unified:
            frees[host.ram_pool] = resident.ram_bytes
        on = ", ".join(sorted(set(resident.gpu_bytes) & gpus))
        reason = f"{_RESIDUAL_REASON} ({gib(held)} on {on}) is needed: parking alone is not enough"
        chosen.append(Victim(resident.deployment_id, resident.name, STOP, frees, 0, reason))
        for pool, amount in frees.items():
            if pool in remaining:
                remaining[pool] -= amount
            if pool in short:
                short[pool] -= amount - _passing(resident, pool)
    return _stops_instead(host, [*victims, *chosen], remaining, short)


def _stops_instead(
    host: HostSnapshot, victims: list[Victim], remaining: dict[str, int], short: dict[str, int]
) -> list[Victim]:
    """``victims``, the least valuable of those that would park stopped instead while
    what they would leave is still ``short`` (GPU pool -> bytes)."""
    parks = sorted((v for v in victims if v.mode != STOP), key=lambda v: _value(host, v))
    for victim in parks:
        if all(lack <= 0 for lack in short.values()):
            break
        resident = next(r for r in host.residents if r.deployment_id == victim.deployment_id)
        left = {p: resident.gpu_bytes.get(p, 0) - victim.frees.get(p, 0) for p in short}
        if not any(amount > 0 for amount in left.values()):
            continue
        on = ", ".join(sorted(p for p, amount in left.items() if amount > 0))
        reason = (
            f"parked, its residual ({gib(sum(left.values()))} on {on}) would still be in the way"
        )
        stop = Victim(victim.deployment_id, victim.name, STOP, dict(resident.gpu_bytes), 0,
                      reason, victim.turn_over)  # fmt: skip
        victims = [stop if v is victim else v for v in victims]
        for pool, amount in left.items():
            remaining[pool] -= amount
            short[pool] -= amount
    return victims


def _passing(resident: Resident, pool: str) -> int:
    """What a parked model holds on ``pool`` beyond its residual: released by its park,
    not yet confirmed free."""
    if resident.state != "parked":
        return 0
    held = resident.gpu_bytes.get(pool, 0)
    return held - expected_residual(resident, held)


def _later(resident: Resident, pool: str, need: Need, taken: set[int]) -> int:
    """What a model that is not parked, and not a victim now (``taken``), would free on
    ``pool`` once parked: nothing when it never will be (pinned, another replica)."""
    if (
        resident.deployment_id in taken
        or resident.state == "parked"
        or resident.pinned
        or resident.deployment_id in need.siblings
        or resident.deployment_id == need.deployment_id
    ):
        return 0
    held = resident.gpu_bytes.get(pool, 0)
    return held - expected_residual(resident, held)


def _value(host: HostSnapshot, victim: Victim) -> tuple[int, float]:
    resident = next(r for r in host.residents if r.deployment_id == victim.deployment_id)
    return (resident.priority, resident.last_used)


def _enough(victims: list[Victim], missing: dict[str, int]) -> bool:
    return all(sum(v.frees.get(pool, 0) for v in victims) >= lack for pool, lack in missing.items())


def plan(hosts: list[HostSnapshot], need: Need) -> Placement | NoCapacity:
    """Where ``need`` runs and who makes room for it."""
    candidates = [
        h for h in hosts if h.online and (need.host_ids is None or h.host_id in need.host_ids)
    ]
    if not candidates:
        return NoCapacity(f"no online host can run {need.name}")
    options: list[tuple[tuple[int, int, int, int, int], Placement]] = []
    waits_behind: list[tuple[Contender, tuple[str, ...]]] = []
    for host in candidates:
        gpu_pools = host.gpu_pools
        count = 1 if host.unified and need.gpus else need.gpus
        if count > len(gpu_pools):
            continue
        taken = _sibling_pools(host, need)
        spread = _siblings_on(host, need) if need.spread == SPREAD_HOSTS else 0
        for pools in combinations(gpu_pools, count):
            if taken.intersection(pools):  # another replica is on one of these GPUs
                continue
            victims = _try_victims(host, pools, need)
            if victims is None:
                continue
            before = turn_before(host, need, pools, bool(victims))
            if before is not None:  # switching here is its turn first
                waits_behind.append((before, pools))
                continue
            slack = sum(host.pools[p].free_bytes - need.claim_per_gpu_bytes for p in pools)
            evicted = sum(sum(v.frees.values()) for v in victims)
            stops = sum(1 for v in victims if v.mode == STOP)
            options.append(
                (
                    (len(victims), stops, spread, evicted, slack),
                    Placement(host.host_id, pools, victims),
                )
            )
    if options:
        options.sort(key=lambda item: item[0])
        return options[0][1]
    if waits_behind:
        before, pools = max(waits_behind, key=lambda item: item[0].standing)
        return turn_refusal(need.name, before, pools)
    result = _why_not(candidates, need)
    if need.siblings and result.lasting:
        # Siblings are the cause when, without them, it would fit or wait for room.
        alone = plan(hosts, replace(need, siblings=frozenset()))
        if isinstance(alone, Placement) or not alone.lasting:
            return NoCapacity(_replicas_reason(candidates, need), result.blockers)
    return result


def _replicas_reason(hosts: list[HostSnapshot], need: Need) -> str:
    """Why ``need`` does not fit where no other replica of it is (one line)."""
    name, size = need.name, gib(need.claim_per_gpu_bytes)
    if all(h.unified for h in hosts) and need.gpus:
        return f"{name} needs {size}; no host without another replica of {name} has room"
    if need.gpus > 1:
        return (
            f"{name} needs {need.gpus} GPUs of {size}; no host has {need.gpus} GPUs without "
            f"another replica of {name} with room"
        )
    return f"{name} needs {size} per GPU; no GPU without another replica of {name} has room"


def _staying(resident: Resident, pool: str) -> int:
    """What ``resident`` keeps on ``pool`` however long a request waits: all of it when
    pinned; else nothing: a ready model will be a victim once its min_ready_seconds and its
    turn are over, and a parked one is stopped where its residual is in the way."""
    held = resident.gpu_bytes.get(pool, 0)
    if resident.pinned:
        return held
    return 0


def _pools_once_unpinned_gone(host: HostSnapshot, need: Need) -> tuple[str, ...] | None:
    """The host's GPU pools where ``need`` would fit once what passes has passed (only
    pinned models and foreign use stay), or None. A CPU deployment (no
    GPUs) never waits for GPU room."""
    count = 1 if host.unified and need.gpus else need.gpus
    taken = _sibling_pools(host, need)  # a replica does not wait for another to leave
    usable = [p for p in host.gpu_pools if p not in taken]
    if count == 0 or count > len(usable):
        return None

    def room(pool: str) -> int:
        staying = sum(_staying(r, pool) for r in host.residents)
        return host.pools[pool].capacity_bytes - host.pools[pool].foreign_bytes - staying

    best = sorted(usable, key=room, reverse=True)[:count]
    if all(room(p) >= need.claim_per_gpu_bytes for p in best):
        return tuple(sorted(best, key=host.gpu_pools.index))
    return None


def _blocker(resident: Resident, need: Need) -> str | None:
    """How ``resident`` is in the way of ``need`` (it will not be a victim now), or None."""
    if resident.deployment_id in need.siblings:
        return f"{resident.name} (another replica)"
    if resident.pinned:
        return f"{resident.name} (pinned)"
    if resident.state != "ready":  # a parked one is stopped where its residual is in the way
        return None if _stoppable_parked(resident, need) else f"{resident.name} ({resident.state})"
    if resident.ready_for_seconds < resident.min_ready_seconds:
        return f"{resident.name} (ready for less than {resident.min_ready_seconds:.0f}s)"
    return _turn_blocker(resident, need) if in_its_turn(resident, need) else None


def _turn_blocker(resident: Resident, need: Need) -> str:
    left = turn_left_for(resident, need)
    if math.isinf(left):  # a batch-only need: it waits until the model is idle
        return f"{resident.name} (busy with interactive requests; batch waits)"
    return f"{resident.name} (busy, its turn: {left:.0f} s left)"


def _why_not(hosts: list[HostSnapshot], need: Need) -> NoCapacity:
    if all(max(need.gpus, 1 if h.unified else 0) > len(h.gpu_pools) for h in hosts) and need.gpus:
        most = max(len(h.gpu_pools) for h in hosts)
        return NoCapacity(f"{need.name} needs {need.gpus} GPUs; the most one host has is {most}")
    blockers = {
        label
        for host in hosts
        for resident in host.residents
        if resident.gpu_bytes and (label := _blocker(resident, need)) is not None
    }
    largest = max((h.pools[p].capacity_bytes for h in hosts for p in h.gpu_pools), default=0)
    if need.claim_per_gpu_bytes > largest:
        reason = (
            f"{need.name} needs {gib(need.claim_per_gpu_bytes)} per GPU; the largest GPU "
            f"pool holds {gib(largest)}"
        )
    elif (pools := next(filter(None, (_pools_once_unpinned_gone(h, need) for h in hosts)),
                        None)) is not None:  # fmt: skip
        passing = sorted(b for b in blockers if not b.endswith(("(pinned)", "(another replica)")))
        reason = f"{need.name} needs {gib(need.claim_per_gpu_bytes)} per GPU and waits for room" + (
            f"; in the way: {', '.join(passing)}" if passing else ""
        )
        return NoCapacity(reason, tuple(sorted(blockers)), lasting=False, pools=pools)
    elif blockers:
        reason = (
            f"{need.name} needs {gib(need.claim_per_gpu_bytes)} per GPU and does not fit even "
            f"with everything parkable parked; in the way: {', '.join(sorted(blockers))}"
        )
    else:
        reason = (
            f"{need.name} needs {gib(need.claim_per_gpu_bytes)} per GPU and does not fit even "
            "with everything parkable parked"
        )
    return NoCapacity(reason, tuple(sorted(blockers)))
