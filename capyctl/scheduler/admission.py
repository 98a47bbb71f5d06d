"""Admission: whether a start or a wake fits, decided and promised under the host lock.

Each call plans on the ledger as it is under the lock and, when the need fits without
victims, makes the transition that promises the memory in the same lock (so nothing can be
admitted into the same bytes meanwhile). Otherwise it names the victims; the verbs in
:mod:`capyctl.scheduler.operations` evict them and ask again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from capyctl.deployments.models import Deployment, Instance, ObservedState
from capyctl.hosts.models import Host
from capyctl.ledger.pools import pool_usage
from capyctl.ledger.services import InsufficientMemoryError, host_lock
from capyctl.scheduler import snapshots, transitions, turns
from capyctl.scheduler.errors import NoCapacityError
from capyctl.scheduler.policy import HostSnapshot, Need, NoCapacity, Placement, Victim, plan


@dataclass(frozen=True)
class Admitted:
    """A start admitted: where, on which pools, and its instance row."""

    host: Host
    placement: Placement
    instance: Instance


def source_host(deployment: Deployment) -> Host:
    """Where the deployment will run: its own host, else the first with room for it now
    (its weights are fetched there, and it is placed there)."""
    if deployment.host is not None:
        return deployment.host
    hosts = list(Host.objects.all())
    if not hosts:
        raise NoCapacityError(f"no host can run {deployment.name}: there are no hosts")
    for host in hosts:
        with host_lock(host.pk) as locked:
            result = plan([snapshots.snapshot(locked)], snapshots.need(deployment, locked))
        if not isinstance(result, NoCapacity):
            return host
    return hosts[0]


def admit_start(
    deployment: Deployment, host: Host, key: str
) -> Admitted | tuple[Victim, ...] | None:
    """One round of placing a start on ``host``: admitted (STARTING, memory promised, the
    instance row made), or the victims to evict first. ``None``: another caller started or
    stopped it meanwhile, and nothing was admitted."""
    with host_lock(host.pk) as locked:
        need = snapshots.need(deployment, locked)
        result = plan([snapshots.snapshot(locked)], need)
        if isinstance(result, NoCapacity):
            raise _refused(deployment, locked, result)
        if result.victims:
            return result.victims
        pools = snapshots.gpu_pools(locked, result.gpu_indices)
        figures = dict.fromkeys(pools, need.claim_per_gpu_bytes)
        ram = snapshots.ram_pool(locked)
        figures[ram] = figures.get(ram, 0) + need.host_ram_bytes
        try:
            instance = transitions.starting(
                locked,
                deployment,
                figures,
                result.gpu_indices,
                key=key,
                claim_bytes=need.claim_per_gpu_bytes,
            )
        except InsufficientMemoryError as exc:
            raise NoCapacityError(f"{deployment.name}: {exc}", lasting=False) from exc
        if instance is None:
            return None
        return Admitted(locked, result, instance)


def admit_wake(
    deployment: Deployment, host: Host, pools: list[str], claim: int
) -> tuple[Victim, ...] | None:
    """Under the host lock: if the claim fits back on its own GPUs, move PARKED -> WAKING
    and promise it (returns ``()``); else name who must make room. ``None``: it is no
    longer a parked model that should run (another caller woke or stopped it)."""
    with host_lock(host.pk) as locked:
        current = (
            Deployment.objects.filter(pk=deployment.pk)
            .values_list("observed_state", "desired_state")
            .first()
        )
        if current != (ObservedState.PARKED, "running"):
            return None
        # Its own entries (held residual, or unconfirmed: they still count the whole claim)
        # are replaced by the promise, so they count as room for it.
        mine = transitions.entries(locked, deployment.pk)
        usage = {u.pool: u for u in pool_usage(locked)}
        if all(usage[p].free_bytes + mine.get(p, 0) >= claim for p in pools if p in usage):
            try:
                won = transitions.waking(locked, deployment, dict.fromkeys(pools, claim), mine)
            except InsufficientMemoryError as exc:
                raise NoCapacityError(f"{deployment.name}: {exc}", lasting=False) from exc
            return () if won else None
        snap = snapshots.snapshot(locked)
        residual = min((mine.get(p, 0) for p in pools), default=0)
        others = HostSnapshot(
            snap.host_id,
            snap.name,
            snap.unified,
            {p: snap.pools[p] for p in (*pools, snap.ram_pool) if p in snap.pools},
            [r for r in snap.residents if r.deployment_id != deployment.pk],
            contenders=snap.contenders,
        )
        need = Need(deployment.pk, deployment.name, len(pools), claim - residual, 0, (host.pk,),
                    turns.waited(deployment.pk), deployment.priority)  # fmt: skip
        result = plan([others], need)
        if isinstance(result, NoCapacity):
            raise _refused(deployment, locked, result, tuple(pools))
        return result.victims or ()


def _refused(
    deployment: Deployment, host: Host, result: NoCapacity, pools: tuple[str, ...] = ()
) -> NoCapacityError:
    """The error for a plan that found no room; a wait for what passes is noted (under
    the host lock), so the contenders for these GPUs take turns in order of their waits."""
    if not result.lasting:
        now = time.time()
        turns.note(turns.Wait(deployment.pk, deployment.name, host.pk, now, now,
                              deployment.priority, result.pools or pools))  # fmt: skip
    return NoCapacityError(result.reason, result.blockers, lasting=result.lasting)
