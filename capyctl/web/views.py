"""Liveness and readiness probes."""

from __future__ import annotations

import logging
import sys

import redis
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from django.views.decorators.http import require_GET

from capyctl.scheduler.errors import is_control_plane_error, outage

logger = logging.getLogger("capyctl.web")


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """Liveness: the process answers. Checks nothing else, so it never flaps."""
    return JsonResponse({"status": "ok"})


def _check_database() -> str:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:  # any driver error means "not ready"
        logger.warning("readiness: the database fails: %s: %s", type(exc).__name__, exc)
        return "failing"
    return "ok"


def _check_broker() -> str:
    if not settings.REDIS_URL:
        return "not configured"
    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
    try:
        client.ping()
    except redis.RedisError as exc:
        logger.warning("readiness: the broker fails: %s: %s", type(exc).__name__, exc)
        return "failing"
    finally:
        client.close()
    return "ok"


@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    """Readiness: the database answers, and the broker too where one is configured. Each
    check says only "ok" or "failing" (anyone may ask); the log says why."""
    checks = {"database": _check_database(), "broker": _check_broker()}
    ready = all(value in ("ok", "not configured") for value in checks.values())
    return JsonResponse(
        {"status": "ok" if ready else "unavailable", "checks": checks}, status=200 if ready else 503
    )


def server_error(request: HttpRequest) -> HttpResponse:
    """The 500 handler: a failure because the database or Redis did not answer is 503 with
    Retry-After (JSON under /api/, a short page elsewhere), not a bare 500; the error was
    logged once by Django with its cause."""
    failure = sys.exc_info()[1]
    if failure is None or not is_control_plane_error(failure):
        return defaults.server_error(request)
    told = outage(failure)
    headers = {"Retry-After": str(told.retry_after)}
    if request.path.startswith("/api/"):
        body = {"detail": told.message, "code": "control_plane_unavailable"}
        return JsonResponse(body, status=503, headers=headers)
    page = f"<!doctype html><title>Unavailable</title><h1>Unavailable</h1><p>{told.message}</p>"
    return HttpResponse(page, status=503, headers=headers)
