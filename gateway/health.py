"""Liveness and readiness: is the database and Redis answering."""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, JsonResponse

from infra.redis_conn import get_redis


def healthz(request: HttpRequest) -> JsonResponse:
    checks: dict[str, str] = {}
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except Exception as exc:  # report, don't crash: this page exists to say what is wrong
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        get_redis().ping()
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = f"error: {type(exc).__name__}"
    healthy = all(v == "ok" for v in checks.values())
    return JsonResponse({"status": "ok" if healthy else "degraded", **checks},
                        status=200 if healthy else 503)
