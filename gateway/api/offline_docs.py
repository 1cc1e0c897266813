"""The API docs pages (Swagger UI, Redoc) load only from this site.

Their scripts and styles come from drf-spectacular-sidecar, the Redoc page's template drops the
Google Fonts links (``templates/drf_spectacular/redoc.html``), and this Content-Security-Policy
stops what the bundles would still fetch on their own (Redoc's "powered by" logo from its CDN,
Swagger's validator badge): the browser never sends those requests, so the docs work offline
and tell no third party who reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, wraps
from pathlib import Path
from typing import Any

from django.contrib.staticfiles import finders
from django.http import Http404, HttpRequest, HttpResponse

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


# Redoc's sidebar credits Redocly with a logo it loads from Redocly's CDN, unconditionally (no
# option turns it off). The policy above would block it, with a console error on every visit;
# the bundle is served here with that one URL replaced by an empty inline image instead.
REDOC_BUNDLE = "drf_spectacular_sidecar/redoc/bundles/redoc.standalone.js"
REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
NO_LOGO = "data:image/svg+xml,%3Csvg xmlns='http://www.w3.org/2000/svg' width='1' height='1'/%3E"


@cache
def redoc_bundle_text() -> bytes:
    path = finders.find(REDOC_BUNDLE)
    if not isinstance(path, str):
        raise Http404("Redoc is not installed (drf-spectacular-sidecar).")
    return Path(path).read_bytes().replace(REDOC_LOGO.encode(), NO_LOGO.encode())


def redoc_bundle(request: HttpRequest) -> HttpResponse:
    response = HttpResponse(redoc_bundle_text(), content_type="text/javascript; charset=utf-8")
    response["Cache-Control"] = "public, max-age=86400"
    return response
