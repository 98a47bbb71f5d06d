"""REST resources of people: teams, API keys and users. Every change goes through the
access services that the CLI and the admin use."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import exceptions, mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from capyctl import reports
from capyctl.access import services as access
from capyctl.access import teams
from capyctl.access.models import ApiKey
from capyctl.api import serializers as s
from capyctl.api.auth import IsAdmin, IsSignedIn, is_admin
from capyctl.api.common import actor, unstored, valid
from capyctl.errors import NotFoundError, UserError
from capyctl.validation import parse_duration

# -- teams ----------------------------------------------------------------------------------


@extend_schema_view(
    list=extend_schema(summary="Teams", responses=s.TeamOut(many=True)),
    retrieve=extend_schema(summary="One team", responses=s.TeamOut),
    create=extend_schema(summary="Add a team", request=s.TeamIn, responses={201: s.TeamOut}),
    partial_update=extend_schema(
        summary="Set a team's priority class", request=s.TeamChange, responses=s.TeamOut
    ),
    destroy=extend_schema(summary="Remove a team no key is charged to", responses={204: None}),
)
class TeamViewSet(viewsets.ViewSet):
    permission_classes = (IsAdmin,)
    lookup_field = "name"
    lookup_value_regex = "[^/]+"
    serializer_class = s.TeamOut

    def list(self, request: Request) -> Response:
        return Response(s.TeamOut(reports.all_teams(), many=True).data)

    def retrieve(self, request: Request, name: str) -> Response:
        return Response(s.TeamOut(self._one(name)).data)

    def create(self, request: Request) -> Response:
        data = valid(s.TeamIn, request)
        teams.add_team(data["name"], priority_class=data["priority_class"], actor=actor(request))
        return Response(s.TeamOut(self._one(data["name"])).data, status=status.HTTP_201_CREATED)

    def partial_update(self, request: Request, name: str) -> Response:
        data = valid(s.TeamChange, request)
        teams.update_team(name, priority_class=data["priority_class"], actor=actor(request))
        return Response(s.TeamOut(self._one(name)).data)

    def destroy(self, request: Request, name: str) -> Response:
        teams.remove_team(name, actor=actor(request))
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(summary="Add a member", request=s.MemberIn, responses=s.TeamOut)
    @action(detail=True, methods=["post"])
    def members(self, request: Request, name: str) -> Response:
        data = valid(s.MemberIn, request)
        teams.add_member(name, data["user"], actor=actor(request))
        return Response(s.TeamOut(self._one(name)).data)

    @extend_schema(summary="Take a member off", responses=s.TeamOut)
    @action(detail=True, methods=["delete"], url_path="members/(?P<user>[^/]+)")
    def member(self, request: Request, name: str, user: str) -> Response:
        teams.remove_member(name, user, actor=actor(request))
        return Response(s.TeamOut(self._one(name)).data)

    @staticmethod
    def _one(name: str) -> Any:
        found = reports.all_teams(name)
        if not found:
            raise NotFoundError(f"no team named {name!r}", field="name")
        return found[0]


# -- keys -----------------------------------------------------------------------------------


@extend_schema_view(
    list=extend_schema(summary="API keys (yours; staff see all)", responses=s.KeyOut(many=True)),
    retrieve=extend_schema(summary="One API key", responses=s.KeyOut),
    create=extend_schema(
        summary="Create an API key; the full key is in this answer only",
        request=s.KeyIn,
        responses={201: s.KeyCreated},
    ),
    partial_update=extend_schema(
        summary="Change a key's name, models, limits, team or priority class",
        request=s.KeyChange,
        responses=s.KeyOut,
    ),
    destroy=extend_schema(
        summary="Revoke a key (within a second on every process)", responses={204: None}
    ),
)
class KeyViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    permission_classes = (IsSignedIn,)
    lookup_field = "key_id"
    lookup_value_regex = "[^/]+"
    filterset_fields = ("is_admin",)
    serializer_class = s.KeyOut
    http_method_names = ("get", "post", "patch", "delete", "head", "options")

    def get_queryset(self) -> QuerySet[ApiKey]:
        keys = reports.keys_query()  # as `capyctl key list` reads them
        if getattr(self, "swagger_fake_view", False):  # the schema generator's pass
            return keys.none()
        if not is_admin(self.request):
            keys = keys.filter(user_id=self.request.user.pk or 0)
        return keys

    def _mine(self, key_id: str) -> ApiKey:
        key = self.get_queryset().filter(key_id=key_id).first()
        if key is None:
            raise exceptions.NotFound(f"no API key with id {key_id!r}")
        return key

    def retrieve(self, request: Request, key_id: str) -> Response:
        return Response(s.KeyOut(self._mine(key_id)).data)

    def create(self, request: Request) -> Response:
        data = valid(s.KeyIn, request)
        owner = data.get("user") or actor(request)
        if owner != actor(request) and not is_admin(request):
            raise exceptions.PermissionDenied("only staff may create keys for other users")
        expires = data.get("expires")
        key, full = access.issue_api_key(
            owner,
            name=data.get("name", ""),
            models=data.get("models"),
            expires_in=parse_duration(expires, field="expires") if expires else None,
            admin=data["admin"],
            requests_per_minute=data.get("requests_per_minute"),
            max_concurrent=data.get("max_concurrent"),
            team=data.get("team"),
            priority_class=data.get("priority_class") or "",
            actor=actor(request),
        )
        return unstored(Response(s.KeyCreated((key, full)).data, status=status.HTTP_201_CREATED))

    def partial_update(self, request: Request, key_id: str) -> Response:
        self._mine(key_id)
        data = valid(s.KeyChange, request)
        key = access.update_api_key(
            key_id,
            name=data.get("name"),
            models=data.get("models"),
            requests_per_minute=data.get("requests_per_minute", access.UNCHANGED),
            max_concurrent=data.get("max_concurrent", access.UNCHANGED),
            team=data.get("team", access.UNCHANGED),
            priority_class=(  # null or empty: its team's
                (data["priority_class"] or "") if "priority_class" in data else access.UNCHANGED
            ),
            actor=actor(request),
        )
        return Response(s.KeyOut(key).data)

    def destroy(self, request: Request, key_id: str) -> Response:
        self._mine(key_id)
        access.revoke_api_key(key_id, actor=actor(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


# -- users ----------------------------------------------------------------------------------


@extend_schema_view(
    list=extend_schema(summary="Users", responses=s.UserOut(many=True)),
    retrieve=extend_schema(summary="One user", responses=s.UserOut),
    create=extend_schema(summary="Add a user", request=s.UserIn, responses={201: s.UserOut}),
    partial_update=extend_schema(
        summary="Set a password, staff, active or ceilings",
        request=s.UserChange,
        responses=s.UserOut,
    ),
    destroy=extend_schema(summary="Remove a user and their keys", responses={204: None}),
)
class UserViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):  # type: ignore[type-arg]
    permission_classes = (IsAdmin,)
    queryset = User.objects.order_by("username")
    lookup_field = "username"
    lookup_value_regex = "[^/]+"
    filterset_fields = (
        "is_staff",
        "is_active",
    )
    serializer_class = s.UserOut
    http_method_names = ("get", "post", "patch", "delete", "head", "options")

    def get_queryset(self) -> QuerySet[User]:
        return reports.users_query()  # each user's keys and ceilings read in bulk

    def retrieve(self, request: Request, username: str) -> Response:
        return Response(s.UserOut(access.get_user(username)).data)

    def create(self, request: Request) -> Response:
        data = valid(s.UserIn, request)
        if data.get("password") is not None and len(data["password"]) < 8:
            raise UserError("a password is at least 8 characters", field="password")
        user = access.add_user(
            data["username"], password=data.get("password"), staff=data["staff"],
            limits=_limits(data), actor=actor(request),
        )  # fmt: skip
        return Response(s.UserOut(user).data, status=status.HTTP_201_CREATED)

    def partial_update(self, request: Request, username: str) -> Response:
        data = valid(s.UserChange, request)
        limits = _limits(data)
        with transaction.atomic():  # all of it or none
            user = access.update_user(username, actor=actor(request), **data)
            if limits:
                access.set_user_limits(username, actor=actor(request), **limits)
        return Response(s.UserOut(user).data)

    def destroy(self, request: Request, username: str) -> Response:
        access.remove_user(username, actor=actor(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


def _limits(data: dict[str, Any]) -> dict[str, Any]:
    """Take the ceilings out of ``data`` as :func:`access.set_user_limits` takes them."""
    limits = {name: data.pop(name) for name in s.LimitsIn.LIMIT_FIELDS if name in data}
    if limits.get("key_lifetime") is not None:
        limits["key_lifetime"] = parse_duration(limits["key_lifetime"], field="key_lifetime")
    return limits
