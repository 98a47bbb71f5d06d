"""Pages of the REST lists."""

from __future__ import annotations

from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request


class Pages(LimitOffsetPagination):
    """``?limit=&offset=``: at most 1000 rows a page, offsets the database can hold."""

    max_limit = 1000

    def get_offset(self, request: Request) -> int:
        return min(super().get_offset(request), 2**62)
