"""Turns: while a busy model keeps its GPUs against the models that wait for them, and
which of those goes next (the contender that has waited longest, each point of priority
counting as :data:`~capyctl.scheduler.placement_data.TURN_PRIORITY_SECONDS` of waiting).
Read by the policy (:mod:`capyctl.scheduler.policy`); plain data, no clock.

Priority classes (a key's, or its team's): a model only batch requests wait for never
ends the turn of a busy model that interactive requests wait for or are served by (not
batch-only): it waits until that model is idle. Its wait counts for
:data:`~capyctl.scheduler.placement_data.BATCH_SHARE` of its seconds among contenders.
A model busy with batch requests only keeps its GPUs against an interactive need for that
share of its ``max_turn_seconds``. Between two of the same class, turns are as without
classes."""

from __future__ import annotations

import math

from capyctl.scheduler.placement_data import (
    BATCH_SHARE,
    Contender,
    HostSnapshot,
    Need,
    NoCapacity,
    Resident,
)


def turn_left(
    busy: bool,
    max_turn_seconds: float,
    waited: float,
    ready_for: float,
    *,
    need_batch: bool = False,
    resident_batch: bool = False,
) -> float:
    """Seconds left of a busy resident's turn against a need that has ``waited`` (0 or
    less: it has no turn to keep): its turn runs from when the need began to wait (or from
    when it became ready, ``ready_for`` seconds ago, if later) for its ``max_turn_seconds``;
    never ends for a batch-only need while the resident is not batch-only; a batch-only
    resident's turn against an interactive need is a :data:`BATCH_SHARE` of it."""
    if not busy:
        return 0.0
    if need_batch and not resident_batch:
        return math.inf
    if resident_batch and not need_batch:
        max_turn_seconds *= BATCH_SHARE
    return max_turn_seconds - min(waited, ready_for)


def turn_left_for(resident: Resident, need: Need) -> float:
    return turn_left(resident.busy, resident.max_turn_seconds, need.waited_seconds,
                     resident.ready_for_seconds, need_batch=need.batch,
                     resident_batch=resident.batch)  # fmt: skip


def in_its_turn(resident: Resident, need: Need) -> bool:
    return turn_left_for(resident, need) > 0


def held_from_batch(host: HostSnapshot, contender: Contender) -> bool:
    """Whether ``contender``, batch-only, waits on GPUs a busy model that is not batch-only
    holds: it cannot have them now however long it has waited, so it holds nobody back."""
    if not contender.batch:
        return False
    pools = set(contender.pools or host.gpu_pools)
    return any(
        r.state == "ready" and r.busy and not r.batch and pools & set(r.gpu_bytes)
        for r in host.residents
    )


def _ahead(host: HostSnapshot, need: Need, pools: tuple[str, ...]) -> Contender | None:
    """The contender for any of ``pools`` that goes before ``need`` (waited longer,
    weighted by priority), if any; a batch-only one that cannot switch now does not
    (:func:`held_from_batch`)."""
    best = None
    for contender in host.contenders:
        if contender.deployment_id == need.deployment_id:
            continue
        if contender.pools and not set(contender.pools) & set(pools):
            continue
        if held_from_batch(host, contender):
            continue
        ahead = contender.goes_before(need.deployment_id, need.standing)
        if ahead and (best is None or contender.standing > best.standing):
            best = contender
    return best


def turn_before(
    host: HostSnapshot, need: Need, pools: tuple[str, ...], switching: bool
) -> Contender | None:
    """Whose turn on ``pools`` comes before ``need``'s: a switch there (``switching``) is
    the turn of whoever waited longer for them; free room is kept for a contender it was
    freed for."""
    if switching:
        return _ahead(host, need, pools)
    free = {p: host.pools[p].free_bytes for p in host.gpu_pools}
    taking = dict.fromkeys(pools, need.claim_per_gpu_bytes)
    return room_kept_for(host.contenders, need.deployment_id, need.standing, free, taking)


def room_kept_for(
    contenders: tuple[Contender, ...] | list[Contender],
    deployment_id: int,
    standing: float,
    free: dict[str, int],
    taking: dict[str, int],
) -> Contender | None:
    """The contender whose room ``taking`` (pool -> bytes) would take, if any: one that
    goes before the deployment, fits in ``free`` (GPU pool -> free bytes) now on the GPUs
    it waits for, and would not fit there once ``taking`` is taken. Room freed for a model
    that waits (a park made to make room for it) is kept for it, not taken by whoever asks
    first; a contender whose claim is not known, or that does not fit even now, does not
    hold anyone back."""
    best = None
    for contender in contenders:
        claim = contender.claim_per_gpu_bytes
        if contender.deployment_id == deployment_id or claim <= 0:
            continue
        if not contender.goes_before(deployment_id, standing):
            continue
        if contender.pools:  # all of its GPUs, each with room for it
            theirs = [p for p in contender.pools if p in free]
            if not theirs or not set(theirs) & set(taking):
                continue
            fits_now = all(free[p] >= claim for p in theirs)
            fits_after = all(free[p] - taking.get(p, 0) >= claim for p in theirs)
        else:  # any one GPU of the host
            fits_now = any(room >= claim for room in free.values())
            fits_after = any(room - taking.get(p, 0) >= claim for p, room in free.items())
        if fits_now and not fits_after and (best is None or contender.standing > best.standing):
            best = contender
    return best


def turn_refusal(name: str, before: Contender, pools: tuple[str, ...]) -> NoCapacity:
    """The answer for ``name`` that waits its turn behind ``before`` for ``pools``."""
    return NoCapacity(
        f"{name} waits for its turn: {before.name} has waited longer "
        f"({before.waited_seconds:.0f} s) for the same GPUs",
        (f"{before.name} (waiting longer)",),
        lasting=False,
        pools=pools,
    )
