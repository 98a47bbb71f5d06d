"""Where each model name goes: the deployment, its state and its engine's address.

An in-memory table, re-read in the background every ``SOFT_TTL_SECONDS`` for the names in
use, never used older than ``TTL_SECONDS``, and read afresh right after a wake.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from django.db.models import Q

from capyctl.deployments import guards
from capyctl.deployments.adapters import adapter_views
from capyctl.deployments.models import Adapter, Deployment, Instance
from capyctl.gateway.cache import WarmCache
from capyctl.gateway.upstream import unix_url

# Host name → pinned certificate fingerprint, for connections that the gateway makes to
# agents' relays (the route reads refresh it); "" or absent: no certificate is trusted.
AGENT_PINS: dict[str, str] = {}

SOFT_TTL_SECONDS = 0.25  # names in use are re-read this often, in the background
TTL_SECONDS = 1.0  # never used older than this


@dataclass(frozen=True)
class Route:
    deployment_id: int
    name: str
    desired_state: str
    observed_state: str
    parked_mode: str
    host: str | None
    # While it runs: its engine's Unix socket (http+unix://) or loopback address, or its
    # agent's relay.
    base_url: str | None
    tls_name: str | None  # a remote host's name: its relay is reached over mutual TLS
    host_state: str
    launch_key: str
    max_waiting: int
    max_queue_seconds: int  # how long a request may wait for it, all told
    ceilings: tuple[tuple[str, int], ...]  # each body field it bounds, with its ceiling
    media_domains: frozenset[str]  # hosts media URLs may name (empty: data: URLs only)
    gpus: tuple[int, ...] = ()  # the GPUs its engine runs on, while it runs
    # A deployment of several replicas (see replicas.py): its replicas kept up, and when
    # one more is brought up.
    target_concurrency: int = 0
    kept_up: int = 1
    scale_up_wait_seconds: int = 0
    affinity: bool = True  # routed by affinity (else by load alone)
    # A deployment of several replicas: each of them (its first, this route, included), in
    # order; () for a deployment of one.
    replicas: tuple[Route, ...] = ()
    kind: str = ""  # its engine's kind (how a request names an adapter to it)
    # What a million prompt tokens, a million completion tokens and a GPU-hour cost.
    prices: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # A request for an adapter of it: the adapter (None: for the deployment itself).
    adapter: AdapterRef | None = None

    @property
    def ref(self) -> int:
        """What a key's allowlist holds for what the request names: the deployment's id, or
        the adapter's as :func:`capyctl.deployments.models.Adapter.ref` gives it."""
        return self.deployment_id if self.adapter is None else self.adapter.ref

    @property
    def asked_for(self) -> str:
        """The model the request named (an adapter, else the deployment)."""
        return self.name if self.adapter is None else self.adapter.name


@dataclass(frozen=True)
class AdapterRef:
    """An adapter a request names, served by its base (the route it is on)."""

    pk: int
    name: str

    @property
    def ref(self) -> int:
        return Adapter.ref_of(self.pk)


def _fetch_many(names: list[str]) -> dict[str, Route]:
    adapters = list(Adapter.objects.filter(name__in=names).values_list("pk", "name", "base__name"))
    bases = {base for _, _, base in adapters} - set(names)
    routes = _fetch_deployments([*names, *bases])
    for pk, name, base in adapters:
        if base in routes:
            routes[name] = replace(routes[base], adapter=AdapterRef(pk, name))
    for base in bases:
        routes.pop(base, None)
    return routes


def _fetch_deployments(names: list[str]) -> dict[str, Route]:
    deployments = list(
        Deployment.objects.filter(Q(name__in=names) | Q(aliases__name__in=names))
        .select_related("host", "engine")
        .prefetch_related("aliases")
        .distinct()
    )
    several = [d.pk for d in deployments if d.replicas > 1 and d.replica_of_id is None]
    rest: dict[int, list[Deployment]] = {}
    if several:
        for row in (
            Deployment.objects.filter(replica_of_id__in=several)
            .select_related("host", "engine")
            .order_by("replica_index")
        ):
            rest.setdefault(int(row.replica_of_id or 0), []).append(row)
    everyone = [*deployments, *(row for rows in rest.values() for row in rows)]
    running = {
        i.deployment_id: i
        for i in Instance.objects.filter(
            deployment__in=[d.pk for d in everyone], state=Instance.State.RUNNING
        ).only("deployment_id", "port", "socket_path", "launch_key", "key", "gpu_indices")
    }
    wanted = set(names)
    routes: dict[str, Route] = {}
    for deployment in deployments:
        route = _route(deployment, running.get(deployment.pk))
        if deployment.pk in rest:
            group = (route, *(_route(row, running.get(row.pk)) for row in rest[deployment.pk]))
            route = replace(route, replicas=group)
        for name in {deployment.name, *(a.name for a in deployment.aliases.all())} & wanted:
            routes[name] = route
    return routes


def _route(deployment: Deployment, instance: Instance | None) -> Route:
    """The route to one deployment (or one replica of it) and its running engine."""
    host = deployment.host
    remote = host is not None and not host.is_local
    base_url = None
    if remote and host is not None:
        AGENT_PINS[host.name] = host.cert_fingerprint  # checked at each TLS handshake
    if instance is not None and (instance.port or instance.socket_path):
        if remote and host is not None:
            base_url = f"https://{host.address}/relay/{instance.key}"
        elif instance.socket_path:
            base_url = unix_url(instance.socket_path)
        else:
            base_url = f"http://127.0.0.1:{instance.port}"
    return Route(
        deployment_id=deployment.pk,
        name=deployment.name,
        desired_state=deployment.desired_state,
        observed_state=deployment.observed_state,
        parked_mode=deployment.parked_mode,
        host=deployment.host.name if deployment.host else None,
        base_url=base_url,
        tls_name=host.name if remote and host is not None else None,
        host_state=host.state if host is not None else "online",
        launch_key=instance.launch_key if instance else "",
        max_waiting=deployment.setting("max_waiting"),
        max_queue_seconds=deployment.setting("max_queue_seconds"),
        ceilings=guards.body_ceilings(deployment.ceilings),
        media_domains=frozenset(deployment.media_domains),
        gpus=tuple(int(i) for i in instance.gpu_indices) if instance else (),
        target_concurrency=deployment.setting("target_concurrency"),
        kept_up=deployment.kept_up,
        scale_up_wait_seconds=deployment.setting("scale_up_wait_seconds"),
        affinity=deployment.routing == "affinity",
        kind=deployment.engine.kind,
        prices=(deployment.price_prompt, deployment.price_completion, deployment.price_gpu_hour),
    )


class RoutingTable:
    """Routes by model name or alias, kept warm (see :class:`WarmCache`): a request for a
    ready model costs no database query; ``fresh=True`` (after a wake) waits for a read."""

    def __init__(self) -> None:
        self._routes: WarmCache[Route] = WarmCache(
            _fetch_many, soft=SOFT_TTL_SECONDS, hard=TTL_SECONDS
        )

    async def close(self) -> None:
        await self._routes.close()

    async def get(self, name: str, *, fresh: bool = False) -> Route | None:
        return await self._routes.get(name, fresh=fresh)


def list_models() -> list[dict[str, object]]:
    """Every deployment, then every adapter (its ``parent`` the base, its state where it
    stands), for ``GET /v1/models`` (filtered by the key by the caller: ``ref``)."""
    deployments = _list_deployments()
    host_of = {d["id"]: d["host"] for d in deployments}
    adapters = [
        {
            "id": view.name,
            "ref": Adapter.ref_of(view.pk),
            "state": view.state,
            "host": host_of.get(view.base),
            "created": view.created,
            "parent": view.base,
        }
        for view in adapter_views()
    ]
    return [*deployments, *adapters]


def _list_deployments() -> list[dict[str, object]]:
    return [
        {
            "id": d.name,
            "ref": d.pk,
            # A model of several replicas is ready when one of them is.
            "state": "ready"
            if any(r.observed_state == "ready" for r in d.replica_set.all())
            else d.observed_state,
            "host": d.host.name if d.host else None,
            "created": int(d.created_at.timestamp()),
        }
        for d in Deployment.objects.filter(replica_of__isnull=True)
        .select_related("host")
        .prefetch_related("replica_set")
        .order_by("name")
    ]
