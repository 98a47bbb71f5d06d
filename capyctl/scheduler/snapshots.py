"""The host as the scheduler sees it: pools, residents and memory figures.

Plain reads of the ledger and deployments, turned into the policy's data (see
:mod:`capyctl.scheduler.policy`), and probe readings turned into ledger figures.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace

from django.db.models import Q

from capyctl.deployments.models import Deployment
from capyctl.hosts.models import Host
from capyctl.ledger.models import LedgerEntry
from capyctl.ledger.pools import LedgerRead, device_total, pool_usage
from capyctl.prepared import Prepared
from capyctl.scheduler import estimates, request_classes, requests_in_progress, steps, turns
from capyctl.scheduler.policy import Contender, HostSnapshot, Need, Pool, Resident
from hostagent.kinds import get_kind
from hostagent.probe import ProcessUsage


def gpu_pools(host: Host, gpu_indices: list[int]) -> list[str]:
    if (host.inventory or {}).get("unified"):
        return ["unified"] if gpu_indices else []
    return [f"gpu{i}" for i in gpu_indices]


def deep_park_refused(deployment: Deployment, can_deep: bool | None = None) -> str:
    """Why ``deployment`` may not park deep though its engine can ("": it may): an engine
    launched with adapter slots whose releases fail to wake from a deep park with LoRA on."""
    if deployment.adapter_slots <= 0:
        return ""
    kind = get_kind(deployment.engine.kind)
    if can_deep is None:
        can_deep = kind.capabilities(deployment.engine.options, deployment.engine.features()).deep
    return str(getattr(kind, "deep_park_with_adapters_fails", "")) if can_deep else ""


def ram_pool(host: Host) -> str:
    return "unified" if (host.inventory or {}).get("unified") else "ram"


# The fields a resident needs (a switch reads them under the host lock: keep it light).
_RESIDENT_FIELDS = (
    "name",
    "observed_state",
    "park",
    "pinned",
    "priority",
    "source",
    "source_bytes",
    "weights_bytes",
    "measured_weights_bytes",
    "measured_residual_bytes",
    "min_ready_seconds",
    "max_turn_seconds",
    "adapter_slots",
    "last_request_at",
    "state_changed_at",
    "created_at",
    "engine__kind",
    "engine__options",
    "engine__park_unverified_at",
    "engine__version",
    "engine__flags",
    "engine__version_note",
)

# The deployments with ledger entries on a host (its residents, and those holding only a
# copy in its RAM), as a snapshot reads them: once a try, so their SQL is built once.
_RESIDENTS = Prepared(
    lambda host_id: (
        Deployment.objects.filter(
            pk__in=LedgerEntry.objects.filter(host_id=host_id, deployment__isnull=False).values(
                "deployment_id"
            )
        )
        .select_related("engine")
        .only(*_RESIDENT_FIELDS)
    ),
    arity=1,
)


def busy(deployment: Deployment, now: float) -> bool:
    """Whether a ready deployment has requests in flight or had one a moment ago (counts
    that cannot be read count as busy: its turn is not cut on a guess)."""
    in_flight = requests_in_progress.count_or_none(deployment.pk)
    if in_flight is None or in_flight > 0:
        return True
    idle = requests_in_progress.idle_seconds(deployment.pk)
    if idle is not None:  # each end is seen here
        return idle < steps.busy_grace(ends_seen_here=True)
    last = deployment.last_request_at
    return last is not None and now - last.timestamp() < steps.busy_grace(ends_seen_here=False)


def turn_holders(waits: list[tuple[str, int, tuple[str, ...]]]) -> dict[str, list[str]]:
    """For each ``(model, host id, pools)`` that waits for room: the ready models that
    hold those GPU pools of its host (all of them when ``pools`` is empty), by name."""
    if not waits:
        return {}
    held = (
        LedgerEntry.objects.filter(
            deployment__observed_state="ready", host_id__in={host for _, host, _ in waits}
        )
        .exclude(pool="ram")
        .values_list("host_id", "pool", "deployment__name")
    )
    rows = list(held)
    return {
        model: sorted({other for host_id, pool, other in rows
                       if host_id == host and other != model and (not pools or pool in pools)})
        for model, host, pools in waits
    }  # fmt: skip


def residents(
    host: Host,
    now: float,
    read: LedgerRead | None = None,
    classes: request_classes.Counts | None = None,
) -> list[Resident]:
    """The deployments with ledger entries on ``host`` (``read``: its entries, when the
    caller read them under this lock hold; ``classes``: the classes of the requests that
    want each, when known)."""
    entries: dict[int, dict[str, int]] = {}
    rows: Iterable[tuple[int, str, str, int]]
    if read is not None:
        rows = [(owner, pool, status, b) for owner, pool, status, b in read.rows
                if owner is not None]  # fmt: skip
    else:
        rows = LedgerEntry.objects.filter(host=host, deployment__isnull=False).values_list(
            "deployment_id", "pool", "status", "bytes"
        )
    ram: dict[int, int] = {}
    unconfirmed: set[int] = set()  # released by a park, not yet seen free by the probe
    for deployment_id, pool, status, num_bytes in rows:
        if status == LedgerEntry.Status.UNCONFIRMED:
            unconfirmed.add(int(deployment_id))
        if pool != "ram":
            entries.setdefault(int(deployment_id), {})[pool] = num_bytes
        else:
            ram[int(deployment_id)] = num_bytes
    residents = []
    for deployment in _resident_rows(host, entries):
        kind = get_kind(deployment.engine.kind)
        capabilities = kind.capabilities(deployment.engine.options, deployment.engine.features())
        deep_refused = deep_park_refused(deployment, capabilities.deep)
        held = entries[deployment.pk]
        changed = deployment.state_changed_at or deployment.created_at
        used = deployment.last_request_at or changed
        is_busy = deployment.observed_state == "ready" and busy(deployment, now)
        residents.append(
            Resident(
                deployment_id=deployment.pk,
                name=deployment.name,
                host_id=host.pk,
                state=deployment.observed_state,
                gpu_bytes={p: b for p, b in held.items() if p != "ram"},
                weights_bytes=estimates.weights_bytes(deployment, sum(held.values())),
                # A park the probe confirmed: what it still holds is its residual; else
                # what its last confirmed park left (None: never parked, the guess).
                residual_bytes=max(held.values(), default=0)
                if deployment.observed_state == "parked" and deployment.pk not in unconfirmed
                else deployment.measured_residual_bytes,
                park_policy=deployment.park,
                can_park_ram=capabilities.ram,
                can_park_deep=capabilities.deep and not deep_refused,
                deep_refused=deep_refused,
                pinned=deployment.pinned,
                priority=deployment.priority,
                last_used=used.timestamp(),
                ready_for_seconds=now - changed.timestamp(),
                min_ready_seconds=deployment.setting("min_ready_seconds"),
                ram_bytes=ram.get(deployment.pk, 0),
                busy=is_busy,
                max_turn_seconds=deployment.setting("max_turn_seconds"),
                parks_unverified=deployment.engine.park_unverified_at is not None,
                batch=is_busy and request_classes.batch_only(classes, deployment.pk, busy=True),
            )
        )
    return residents


def _resident_rows(host: Host, entries: dict[int, dict[str, int]]) -> list[Deployment]:
    """The rows of the deployments in ``entries``, by name: those the host's ledger names
    now (one prepared query), and any whose entries went since they were read."""
    rows = [d for d in _RESIDENTS(host.pk) if d.pk in entries]  # not those of host RAM only
    gone = set(entries) - {d.pk for d in rows}
    if gone:
        rows += (
            Deployment.objects.filter(pk__in=gone).select_related("engine").only(*_RESIDENT_FIELDS)
        )
        rows.sort(key=lambda d: d.name)
    return rows


def snapshot(
    host: Host, read: LedgerRead | None = None, classes: request_classes.Counts | None = None
) -> HostSnapshot:
    """The host as the policy sees it: pools with what the ledger counts, and residents.
    ``read``: the host's ledger entries, when the caller read them under this lock hold;
    ``classes``: the request classes read for this try (else read here)."""
    pools = {
        u.pool: Pool(u.pool, u.capacity_bytes, u.used_bytes, u.foreign_bytes)
        for u in (read.usage() if read is not None else pool_usage(host))
    }
    if classes is None:
        classes = request_classes.demand()
    return HostSnapshot(
        host_id=host.pk,
        name=host.name,
        unified=bool((host.inventory or {}).get("unified")),
        pools=pools,
        residents=residents(host, time.time(), read, classes),
        online=host.state != Host.State.UNREACHABLE,
        contenders=contenders(host.pk, classes),
    )


def contenders(host_id: int, classes: request_classes.Counts | None) -> tuple[Contender, ...]:
    """Those waiting for room on the host, each with its class (``classes``: the counts of
    :func:`capyctl.scheduler.request_classes.demand`)."""
    return tuple(
        replace(c, batch=request_classes.batch_only(classes, c.deployment_id))
        for c in turns.contenders(host_id)
    )


def need(deployment: Deployment, host: Host, classes: request_classes.Counts | None = None) -> Need:
    """What ``deployment`` needs on ``host`` (``classes``: the request classes read for
    this try, else read here)."""
    group = siblings(deployment)
    if classes is None:
        classes = request_classes.demand()
    return Need(
        deployment_id=deployment.pk,
        name=deployment.name,
        gpus=deployment.gpus,
        claim_per_gpu_bytes=estimates.claim_per_gpu(deployment, device_total(host)),
        host_ram_bytes=estimates.ENGINE_RAM_ESTIMATE,
        host_ids=(host.pk,),
        waited_seconds=turns.waited(deployment.pk),
        priority=deployment.priority,
        siblings=group,
        spread=deployment.spread,
        batch=request_classes.batch_only(classes, deployment.pk, group=group),
    )


def siblings(deployment: Deployment) -> frozenset[int]:
    """The other replicas of its deployment (none for a deployment of one replica)."""
    if deployment.replicas <= 1 and deployment.replica_of_id is None:
        return frozenset()
    first = deployment.replica_of_id or deployment.pk
    rows = Deployment.objects.filter(Q(pk=first) | Q(replica_of_id=first)).exclude(pk=deployment.pk)
    return frozenset(rows.values_list("pk", flat=True))


def measured(
    host: Host, gpu_pools: list[str], usage: ProcessUsage, fallback: int
) -> dict[str, int]:
    """Ledger figures from a probe reading (unknown per-GPU figures keep the claim)."""
    figures = {}
    unified = bool((host.inventory or {}).get("unified"))
    for pool in gpu_pools:
        index = 0 if unified else int(pool[3:])
        value = usage.gpu.get(index)
        figures[pool] = fallback if value is None else int(value)
    if not unified:
        figures["ram"] = usage.host_bytes
    return figures


def launch_keeps_ram_copy(deployment: Deployment, host: Host) -> bool:
    """Whether its engine is launched ready for ``ram`` parks (SGLang's CPU backup): when
    its park policy allows RAM and the host is not unified."""
    return deployment.park in ("auto", "ram") and not (host.inventory or {}).get("unified")
