"""403, 404 and 500 pages inside the portal's layout, with its navigation, for humans.

The JSON APIs (``/v1``, ``/api``) answer their own error shapes before these run. The 500 page
must render even when the database is what failed, so it builds the menu only if it can.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.templatetags.static import static
from django.urls import Resolver404, resolve
from django.views.decorators.csrf import requires_csrf_token

from gateway.portal.tenancy import context_processor

log = logging.getLogger(__name__)


def _render(request: HttpRequest, template: str, status: int, **extra: object) -> HttpResponse:
    try:
        context = context_processor(request)
    except Exception:  # a broken database must not turn the error page into another error
        log.warning("error page rendered without navigation", exc_info=True)
        context = {}
    return render(request, template, {**context, **extra}, status=status)


@requires_csrf_token
def forbidden(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    reason = str(exception) if exception and str(exception) else ""
    return _render(request, "portal/errors/403.html", 403, reason=reason)


@requires_csrf_token
def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    return _render(request, "portal/errors/404.html", 404)


@requires_csrf_token
def server_error(request: HttpRequest) -> HttpResponse:
    return _render(request, "portal/errors/500.html", 500)


def landing(request: HttpRequest) -> HttpResponse:
    """The site's front page (the admin's "View site" lands here)."""
    return _render(request, "portal/landing.html", 200)


def favicon(request: HttpRequest) -> HttpResponse:
    """Browsers (and the admin, and the API docs) ask for /favicon.ico."""
    return redirect(static("portal/favicon.svg"), permanent=True)


class FriendlyNotFoundMiddleware:
    """With ``DEBUG`` on (the quick start), Django answers a 404 with its technical page (URL
    patterns, settings hints) instead of ``handler404``; a newcomer clicking around should see
    the portal's page, as in production. Off ``DEBUG`` this does nothing: Django already uses
    ``handler404``. A path that only lacks its trailing slash is left to ``APPEND_SLASH``."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if settings.DEBUG and not _resolves(request.path_info) and not (
                settings.APPEND_SLASH and _resolves(request.path_info + "/")):
            return not_found(request)
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if settings.DEBUG and isinstance(exception, Http404):
            return not_found(request, exception)
        return None


def _resolves(path: str) -> bool:
    try:
        resolve(path)
    except Resolver404:
        return False
    return True
