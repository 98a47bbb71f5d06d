"""REST resources: engines, adapters, deployments (with start/stop/park/wake), hosts, the
ledger, events and operations (teams, keys and users: :mod:`capyctl.api.people_views`;
budgets and usage: :mod:`capyctl.api.budget_views`). Every change goes through the
service layer that the CLI and the admin use, so the three accept and refuse the same
things."""

from __future__ import annotations

import datetime as dt
from typing import Any, ClassVar

from django.db.models import QuerySet
from django_filters import rest_framework as filters
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import exceptions, mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import exception_handler

from capyctl import reports
from capyctl.api import serializers as s
from capyctl.api.auth import IsAdmin
from capyctl.api.common import actor, unstored, valid
from capyctl.deployments import adapters
from capyctl.deployments import services as deployments
from capyctl.deployments.models import Deployment
from capyctl.engines import services as engines
from capyctl.engines.models import Engine
from capyctl.errors import NotFoundError, UserError
from capyctl.events.models import Event
from capyctl.hosts import services as hosts
from capyctl.ledger.models import LedgerEntry
from capyctl.scheduler import host_states, intents
from capyctl.scheduler.errors import ControlPlaneUnavailableError
from capyctl.scheduler.models import Operation
from capyctl.validation import parse_gpu_memory, parse_size_value


def handle_errors(exc: Exception, context: dict[str, Any]) -> Response | None:
    """A service's :class:`UserError` becomes a 400 naming its field (404 when the thing
    named does not exist; 503 with Retry-After when Redis or the database did not answer);
    the rest is DRF's usual JSON."""
    if isinstance(exc, ControlPlaneUnavailableError):  # nothing wrong with the request
        return Response(
            {"detail": exc.message, "code": exc.code}, status=503, headers={"Retry-After": "1"}
        )
    if isinstance(exc, NotFoundError):
        exc = exceptions.NotFound(exc.message)
    elif isinstance(exc, UserError):
        exc = exceptions.ValidationError({exc.field or "non_field_errors": [exc.message]})
    return exception_handler(exc, context)


# -- engines --------------------------------------------------------------------------------


class EngineFilter(filters.FilterSet):
    host = filters.CharFilter(field_name="host__name")

    class Meta:
        model = Engine
        fields = (
            "kind",
            "host",
        )


@extend_schema_view(
    list=extend_schema(summary="Engines", responses=s.EngineOut(many=True)),
    retrieve=extend_schema(summary="One engine", responses=s.EngineOut),
    create=extend_schema(
        summary="Register an engine", request=s.EngineIn, responses={201: s.EngineOut}
    ),
    partial_update=extend_schema(
        summary="Change an engine", request=s.EngineIn(partial=True), responses=s.EngineOut
    ),
    destroy=extend_schema(
        summary="Remove an engine (not while deployments use it)", responses={204: None}
    ),
)
class EngineViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    permission_classes = (IsAdmin,)
    queryset = reports.engines_query()  # as `capyctl engine list` reads them
    lookup_field = "name"
    lookup_value_regex = "[^/]+"
    filterset_class = EngineFilter
    serializer_class = s.EngineOut
    http_method_names = ("get", "post", "patch", "delete", "head", "options")

    def retrieve(self, request: Request, name: str) -> Response:
        return Response(s.EngineOut(engines.get_engine(name)).data)

    def create(self, request: Request) -> Response:
        data = valid(s.EngineIn, request)
        engine = engines.add_engine(
            data["name"], kind=data["kind"], command=data["command"], host=data.get("host"),
            env=data.get("env"), options=data.get("options"), actor=actor(request),
        )  # fmt: skip
        return Response(s.EngineOut(engine).data, status=status.HTTP_201_CREATED)

    def partial_update(self, request: Request, name: str) -> Response:
        data = valid(s.EngineIn, request, partial=True)
        engine = engines.update_engine(
            name, new_name=data.get("name"), kind=data.get("kind"), command=data.get("command"),
            host=data.get("host"), clear_host="host" in data and data["host"] is None,
            env=data.get("env"), options=data.get("options"), actor=actor(request),
        )  # fmt: skip
        return Response(s.EngineOut(engine).data)

    def destroy(self, request: Request, name: str) -> Response:
        engines.remove_engine(name, actor=actor(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


# -- adapters -------------------------------------------------------------------------------


@extend_schema_view(
    list=extend_schema(summary="Adapters", responses=s.AdapterOut(many=True)),
    retrieve=extend_schema(summary="One adapter", responses=s.AdapterOut),
    create=extend_schema(
        summary="Add an adapter (loaded when first asked for)",
        request=s.AdapterIn,
        responses={201: s.AdapterOut},
    ),
    destroy=extend_schema(
        summary="Remove an adapter (not while an engine holds it)", responses={204: None}
    ),
)
class AdapterViewSet(viewsets.ViewSet):
    permission_classes = (IsAdmin,)
    lookup_field = "name"
    lookup_value_regex = "[^/]+"
    serializer_class = s.AdapterOut

    def list(self, request: Request) -> Response:
        return Response(s.AdapterOut(reports.all_adapters(), many=True).data)

    def retrieve(self, request: Request, name: str) -> Response:
        found = adapters.adapter_views([name])
        if not found:
            raise NotFoundError(f"no adapter named {name!r}", field="name")
        return Response(s.AdapterOut(found[0]).data)

    def create(self, request: Request) -> Response:
        data = valid(s.AdapterIn, request)
        added = adapters.add_adapter(
            data["name"], data["base"], data["source"], actor=actor(request)
        )
        intents.restart_to_take(added, actor=actor(request))
        view = adapters.adapter_views([data["name"]])[0]
        return Response(s.AdapterOut(view).data, status=status.HTTP_201_CREATED)

    def destroy(self, request: Request, name: str) -> Response:
        adapters.remove_adapter(name, actor=actor(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


# -- deployments ----------------------------------------------------------------------------


class DeploymentFilter(filters.FilterSet):
    engine = filters.CharFilter(field_name="engine__name")
    host = filters.CharFilter(field_name="host__name")

    class Meta:
        model = Deployment
        fields = (
            "observed_state",
            "desired_state",
            "engine",
            "host",
            "pinned",
        )


def _spec(
    data: dict[str, Any], base: deployments.DeploymentSpec | None
) -> deployments.DeploymentSpec:
    """A deployment's full settings from the request, on top of ``base`` for a change."""
    fields = dict(vars(base)) if base is not None else {"aliases": [], "engine_args": []}
    plain = {k: v for k, v in data.items() if k not in ("gpu_memory", "weights_size")}
    fields.update({k: v for k, v in plain.items() if v is not None or k == "host"})
    if "gpu_memory" in data:
        value = data["gpu_memory"]
        gpu_bytes, fraction = parse_gpu_memory(value) if value else (None, None)
        fields["gpu_memory_bytes"], fields["gpu_memory_fraction"] = gpu_bytes, fraction
    if "weights_size" in data:
        value = data["weights_size"]
        fields["weights_bytes"] = parse_size_value(value, field="weights_size") if value else None
    if base is not None:  # a setting sent as null goes back to its default
        for name, value in data.items():
            if value is None and name.endswith(("_seconds", "max_waiting")):
                fields[name] = None
    return deployments.DeploymentSpec(**fields)


@extend_schema_view(
    list=extend_schema(summary="Deployments", responses=s.DeploymentOut(many=True)),
    retrieve=extend_schema(summary="One deployment (by name or alias)", responses=s.DeploymentOut),
    create=extend_schema(
        summary="Add a deployment", request=s.DeploymentIn, responses={201: s.DeploymentOut}
    ),
    partial_update=extend_schema(
        summary="Change a deployment's settings (next start)",
        request=s.DeploymentIn(partial=True),
        responses=s.DeploymentOut,
    ),
    destroy=extend_schema(summary="Remove a stopped deployment", responses={204: None}),
)
class DeploymentViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    permission_classes = (IsAdmin,)
    queryset = reports.deployments_query()  # as `capyctl deployment list` reads them
    lookup_field = "name"
    lookup_value_regex = "[^/]+"
    filterset_class = DeploymentFilter
    serializer_class = s.DeploymentOut
    http_method_names = ("get", "post", "patch", "delete", "head", "options")

    def retrieve(self, request: Request, name: str) -> Response:
        return Response(s.DeploymentOut(deployments.get_deployment(name)).data)

    def create(self, request: Request) -> Response:
        spec = _spec(valid(s.DeploymentIn, request), None)
        deployment = deployments.add_deployment(spec, actor=actor(request))
        return Response(s.DeploymentOut(deployment).data, status=status.HTTP_201_CREATED)

    def partial_update(self, request: Request, name: str) -> Response:
        current = deployments.get_deployment(name)
        spec = _spec(valid(s.DeploymentIn, request, partial=True), deployments.spec_of(current))
        deployment = deployments.update_deployment(current.name, spec, actor=actor(request))
        return Response(s.DeploymentOut(deployment).data)

    def destroy(self, request: Request, name: str) -> Response:
        deployments.remove_deployment(name, actor=actor(request))
        return Response(status=status.HTTP_204_NO_CONTENT)

    def _act(self, request: Request, name: str, verb: str) -> Response:
        deployment = deployments.get_deployment(name)
        data = valid(s.ActionIn, request)
        op = intents.request_action(
            deployment, verb, mode=data.get("mode", ""), actor=actor(request)
        )
        if op is None:  # no server runs: only the desired state was saved
            return Response(s.DeploymentOut(Deployment.objects.get(pk=deployment.pk)).data,
                            status=status.HTTP_202_ACCEPTED)  # fmt: skip
        if data["wait"]:
            op = intents.wait_for(op, data["wait"])
        done = op.status in (Operation.Status.DONE, Operation.Status.FAILED)
        return Response(
            s.OperationOut(op).data, status=status.HTTP_200_OK if done else status.HTTP_202_ACCEPTED
        )

    _action_doc: ClassVar[dict[str, Any]] = {
        "request": s.ActionIn,
        "responses": {200: s.OperationOut, 202: s.OperationOut},
        "description": "Saves the intent as an operation and answers 202 with it; with "
        "`wait`, answers 200 once it is done or failed. Poll `/api/operations/{id}/`.",
    }

    @extend_schema(summary="Start (desired state running)", **_action_doc)
    @action(detail=True, methods=["post"])
    def start(self, request: Request, name: str) -> Response:
        return self._act(request, name, "start")

    @extend_schema(summary="Stop (desired state stopped)", **_action_doc)
    @action(detail=True, methods=["post"])
    def stop(self, request: Request, name: str) -> Response:
        return self._act(request, name, "stop")

    @extend_schema(summary="Park: give back its GPU memory", **_action_doc)
    @action(detail=True, methods=["post"])
    def park(self, request: Request, name: str) -> Response:
        return self._act(request, name, "park")

    @extend_schema(summary="Wake a parked deployment", **_action_doc)
    @action(detail=True, methods=["post"])
    def wake(self, request: Request, name: str) -> Response:
        return self._act(request, name, "wake")

    @extend_schema(summary="Restart its engines (mode rolling: one replica at a time)",
                   **_action_doc)  # fmt: skip
    @action(detail=True, methods=["post"])
    def restart(self, request: Request, name: str) -> Response:
        return self._act(request, name, "restart")


# -- hosts ----------------------------------------------------------------------------------


@extend_schema_view(
    list=extend_schema(summary="Hosts with their memory pools", responses=s.HostOut(many=True)),
    retrieve=extend_schema(summary="One host", responses=s.HostOut),
    create=extend_schema(
        summary="Register a remote host; answers its one-time join token",
        request=s.HostIn,
        responses={201: s.HostAdded},
    ),
    partial_update=extend_schema(
        summary="Change a host's address or reserves", request=s.HostChange, responses=s.HostOut
    ),
    destroy=extend_schema(summary="Forget a host (not while used)", responses={204: None}),
)
class HostViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    permission_classes = (IsAdmin,)
    queryset = reports.hosts_query()  # as `capyctl host list` reads them
    lookup_field = "name"
    lookup_value_regex = "[^/]+"
    filterset_fields = ("state",)
    serializer_class = s.HostOut
    http_method_names = ("get", "post", "patch", "delete", "head", "options")

    def retrieve(self, request: Request, name: str) -> Response:
        return Response(s.HostOut(hosts.get_host(name)).data)

    def create(self, request: Request) -> Response:
        data = valid(s.HostIn, request)
        host, token = hosts.add_host(data["name"], data["address"])
        return unstored(Response(s.HostAdded((host, token)).data, status=status.HTTP_201_CREATED))

    def partial_update(self, request: Request, name: str) -> Response:
        data = valid(s.HostChange, request)
        reserves = {k: v for k, v in data.items() if k.endswith("_reserve_bytes")}
        host = hosts.update_host(
            name, address=data.get("address"), reserves=reserves, actor=actor(request)
        )
        return Response(s.HostOut(host).data)

    def destroy(self, request: Request, name: str) -> Response:
        host_states.remove_host(name)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        summary="A new one-time join token (earlier ones stop working)",
        request=None,
        responses=s.HostAdded,
    )
    @action(detail=True, methods=["post"])
    def token(self, request: Request, name: str) -> Response:
        host = hosts.get_host(name)
        if host.is_local:
            raise UserError(f"{name!r} is the in-process host; it does not join", field="name")
        return unstored(Response(s.HostAdded((host, hosts.new_join_token(host))).data))

    @extend_schema(
        summary="Stop trusting the host's certificate at once (it must join again)",
        request=None,
        responses=s.HostOut,
    )
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, name: str) -> Response:
        host = host_states.revoke_host(name, actor=actor(request))
        return Response(s.HostOut(host).data)

    @extend_schema(
        summary="Place nothing new on the host, and move its models to other hosts",
        request=None,
        responses=s.HostOut,
    )
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, name: str) -> Response:
        return Response(s.HostOut(host_states.drain_host(name, actor=actor(request))).data)

    @extend_schema(summary="Let models be placed on the host again", request=None,
                   responses=s.HostOut)  # fmt: skip
    @action(detail=True, methods=["post"])
    def undrain(self, request: Request, name: str) -> Response:
        return Response(s.HostOut(host_states.undrain_host(name, actor=actor(request))).data)


# -- read-only records ----------------------------------------------------------------------


class LedgerFilter(filters.FilterSet):
    host = filters.CharFilter(field_name="host__name")
    deployment = filters.CharFilter(field_name="deployment__name")

    class Meta:
        model = LedgerEntry
        fields = (
            "host",
            "pool",
            "status",
            "deployment",
        )


@extend_schema_view(
    list=extend_schema(summary="Ledger entries: what each model holds or was promised"),
    retrieve=extend_schema(summary="One ledger entry"),
)
class LedgerViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    permission_classes = (IsAdmin,)
    queryset = LedgerEntry.objects.select_related("host", "deployment").order_by(
        "host__name", "pool", "id"
    )
    serializer_class = s.LedgerOut
    filterset_class = LedgerFilter


class UtcDateTimeFilter(filters.IsoDateTimeFilter):
    """``?since=``: an ISO time, turned to UTC before it reaches the database; PostgreSQL
    refuses offsets past ±15:59 that Python accepts (schemathesis sent +19:04)."""

    def filter(self, qs: QuerySet[Any], value: Any) -> QuerySet[Any]:
        if value is not None:
            try:
                value = value.astimezone(dt.UTC)
            except OverflowError:
                raise exceptions.ValidationError({"since": ["the time is out of range"]}) from None
        return super().filter(qs, value)


class EventFilter(filters.FilterSet):
    deployment = filters.CharFilter(field_name="deployment__name")
    host = filters.CharFilter(field_name="host__name")
    since = UtcDateTimeFilter(field_name="created_at", lookup_expr="gte")
    kind = filters.CharFilter(field_name="kind", lookup_expr="startswith")

    class Meta:
        model = Event
        fields = (
            "kind",
            "level",
            "subject",
            "deployment",
            "host",
            "since",
        )


@extend_schema_view(
    list=extend_schema(summary="Events, newest first"), retrieve=extend_schema(summary="One event")
)
class EventViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    permission_classes = (IsAdmin,)
    queryset = Event.objects.order_by("-created_at", "-id")
    serializer_class = s.EventOut
    filterset_class = EventFilter


@extend_schema_view(
    list=extend_schema(summary="Operations asked for, newest first"),
    retrieve=extend_schema(summary="One operation: poll it after an action"),
)
class OperationViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    permission_classes = (IsAdmin,)
    queryset = Operation.objects.select_related("deployment").order_by("-created_at", "-id")
    serializer_class = s.OperationOut
    filterset_fields = (
        "status",
        "action",
    )
