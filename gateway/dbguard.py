"""A database outage answers 503 with what is wrong, not a 500 traceback page.

Admin, portal and management API pages all need PostgreSQL; when it is unreachable (connection
refused, reset, timed out) Django raises ``OperationalError``/``InterfaceError`` from wherever the
first query ran. This middleware turns exactly those into a 503 with ``Retry-After``: JSON for
``/api/`` and ``/v1/`` paths, a short HTML page elsewhere. Other errors are not touched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse

log = logging.getLogger(__name__)

MESSAGE = "The database is unavailable; please retry shortly."
PAGE = (b"<!doctype html><title>Service unavailable</title><h1>503 Service unavailable</h1>"
        b"<p>The database is unavailable, so this page cannot be shown. Inference keeps "
        b"working for recently seen API keys; usage is buffered and written when it returns."
        b"</p>")


class DatabaseUnavailableMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            return self.get_response(request)
        except (OperationalError, InterfaceError) as exc:
            return unavailable(request, exc)

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        if isinstance(exc, OperationalError | InterfaceError):
            return unavailable(request, exc)
        return None


def unavailable(request: HttpRequest, exc: Exception) -> HttpResponse:
    log.error("database unavailable for %s: %s", request.path, type(exc).__name__)
    if request.path.startswith(("/api/", "/v1/")):
        response: HttpResponse = JsonResponse(
            {"error": {"message": MESSAGE, "type": "server_error", "param": None,
                       "code": "database_unavailable"}}, status=503)
    else:
        response = HttpResponse(PAGE, status=503, content_type="text/html")
    response["Retry-After"] = "5"
    return response
