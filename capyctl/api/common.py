"""What the REST views share: who acts, answers no cache may keep, and checked input."""

from __future__ import annotations

from typing import Any

from django.utils.cache import add_never_cache_headers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import Serializer


def actor(request: Request) -> str:
    return str(request.user.get_username())


def unstored(response: Response) -> Response:
    """An answer that holds a secret (a new key, a join token): no cache may keep it."""
    add_never_cache_headers(response)
    return response


def valid(serializer_class: type[Serializer[Any]], request: Request, **kw: Any) -> dict[str, Any]:
    serializer = serializer_class(data=request.data, **kw)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)
