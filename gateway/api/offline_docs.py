"""The API docs pages (Swagger UI, Redoc) load only from this site.

Their scripts and styles come from drf-spectacular-sidecar, the Redoc page's template drops the
Google Fonts links (``templates/drf_spectacular/redoc.html``), and this Content-Security-Policy
stops what the bundles would still fetch on their own (Redoc's "powered by" logo from its CDN,
Swagger's validator badge): the browser never sends those requests, so the docs work offline
and tell no third party who reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.http import HttpRequest, HttpResponse

POLICY = ("default-src 'self'; img-src 'self' data:; font-src 'self' data:; "
          "style-src 'self' 'unsafe-inline'; script-src 'self' 'unsafe-inline'; "
          "worker-src 'self' blob:; connect-src 'self'; frame-ancestors 'self'")


def same_origin_only(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        response = view(request, *args, **kwargs)
        response["Content-Security-Policy"] = POLICY
        return response

    return wrapper
