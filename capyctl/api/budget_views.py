"""``/api/budgets/`` and ``/api/usage/``: budgets (staff and admin keys) and what was used
(anyone signed in: staff see everything, a user their own keys and their teams)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import serializers, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from capyctl.access import budgets
from capyctl.access.usage import BY, usage_by
from capyctl.api.auth import IsAdmin, IsSignedIn, is_admin
from capyctl.errors import UserError
from capyctl.validation import parse_duration


class BudgetIn(serializers.Serializer):  # type: ignore[type-arg]
    """One of ``key``, ``user``, ``team``; at least one of ``tokens``, ``gpu_seconds``,
    ``spend``."""

    key = serializers.CharField(required=False, max_length=64, help_text="a key's id")
    user = serializers.CharField(required=False, max_length=150)
    team = serializers.CharField(required=False, max_length=63)
    tokens = serializers.IntegerField(required=False, allow_null=True, min_value=1,
                                      max_value=budgets.MAX_TOKENS)  # fmt: skip
    gpu_seconds = serializers.FloatField(required=False, allow_null=True, min_value=0.001,
                                         max_value=budgets.MAX_GPU_SECONDS)  # fmt: skip
    spend = serializers.FloatField(required=False, allow_null=True, min_value=0.000001,
                                   max_value=budgets.MAX_SPEND)  # fmt: skip
    period = serializers.ChoiceField(choices=["day", "week", "month", "total"])
    soft_percent = serializers.IntegerField(required=False, allow_null=True, min_value=1,
                                            max_value=100)  # fmt: skip


class BudgetOut(serializers.Serializer):  # type: ignore[type-arg]
    id = serializers.IntegerField()
    scope = serializers.ChoiceField(choices=["key", "user", "team"])
    of = serializers.CharField(help_text="the key's prefix, the user's or the team's name")
    period = serializers.CharField()
    tokens = serializers.IntegerField(allow_null=True)
    gpu_seconds = serializers.FloatField(allow_null=True)
    spend = serializers.FloatField(allow_null=True)
    soft_percent = serializers.IntegerField(allow_null=True)
    used_tokens = serializers.IntegerField(help_text="in the current period")
    used_gpu_seconds = serializers.FloatField(help_text="in the current period")
    used_spend = serializers.FloatField(help_text="in the current period")
    resets_at = serializers.CharField(allow_null=True, help_text="null: a total budget")


class UsageOut(serializers.Serializer):  # type: ignore[type-arg]
    name = serializers.CharField(
        allow_null=True, help_text="the team (null: no team), user, key id or model (by ?by=)"
    )
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    tokens = serializers.IntegerField()
    gpu_seconds = serializers.FloatField(help_text="switches' shares included")
    switch_gpu_seconds = serializers.FloatField()
    spend = serializers.FloatField(help_text="at the models' prices when they ran")


def _scope_filter(request: Request) -> dict[str, str | None]:
    return {name: request.query_params.get(name) for name in ("key", "user", "team")}


@extend_schema_view(
    list=extend_schema(
        summary="Budgets, with what each period used so far", responses=BudgetOut(many=True)
    ),
    retrieve=extend_schema(summary="One budget", responses=BudgetOut),
    create=extend_schema(
        summary="Set the budget of a key, user or team for a period (one a period: setting "
        "it again changes it)",
        request=BudgetIn,
        responses={201: BudgetOut, 200: BudgetOut},
    ),
    destroy=extend_schema(summary="Remove a budget", responses={204: None}),
)
class BudgetViewSet(viewsets.ViewSet):
    permission_classes = (IsAdmin,)
    serializer_class = BudgetOut

    def list(self, request: Request) -> Response:
        return Response(budgets.budget_rows(budgets.budgets(**_scope_filter(request))))

    def retrieve(self, request: Request, pk: str) -> Response:
        return Response(budgets.budget_row(budgets.get_budget(pk)))

    def create(self, request: Request) -> Response:
        given = BudgetIn(data=request.data)
        given.is_valid(raise_exception=True)
        data: dict[str, Any] = dict(given.validated_data)
        budget, made = budgets.set_budget(
            key=data.get("key"), user=data.get("user"), team=data.get("team"),
            tokens=data.get("tokens"), gpu_seconds=data.get("gpu_seconds"), spend=data.get("spend"),
            period=data["period"], soft_percent=data.get("soft_percent"),
            actor=str(request.user.get_username()),
        )  # fmt: skip
        return Response(
            budgets.budget_row(budget),
            status=status.HTTP_201_CREATED if made else status.HTTP_200_OK,
        )

    def destroy(self, request: Request, pk: str) -> Response:
        budgets.remove_budget(pk, actor=str(request.user.get_username()))
        return Response(status=status.HTTP_204_NO_CONTENT)


class UsageView(APIView):
    permission_classes = (IsSignedIn,)

    @extend_schema(
        summary="What was used, by team, user, key or model (a user sees their own keys and "
        "teams; staff everything)",
        parameters=[
            OpenApiParameter("by", str, enum=list(BY), description="default: key"),
            OpenApiParameter("since", str, description="how far back: 12h, 7d, 4w (default 7d)"),
        ],
        responses=UsageOut(many=True),
    )  # fmt: skip
    def get(self, request: Request) -> Response:
        by = request.query_params.get("by", "key")
        if by not in BY:
            raise UserError(f"by must be one of {', '.join(BY)}", field="by")
        span = parse_duration(request.query_params.get("since", "7d"), field="since")
        since = datetime.now(UTC) - span
        user_id = None if is_admin(request) else request.user.pk
        rows = usage_by(by, since, user_id=user_id)
        return Response([{"name": row.pop(by), **row} for row in rows])
