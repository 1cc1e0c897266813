"""Rendering with the portal's navigation context."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from gateway.portal.tenancy import context_processor
from infra import sealed_once


def page(request: HttpRequest, template: str, context: dict[str, Any] | None = None,
         status: int = 200) -> HttpResponse:
    return render(request, template, {**context_processor(request), **(context or {})},
                  status=status)


def secret_page(request: HttpRequest, template: str, context: dict[str, Any]) -> HttpResponse:
    """A page that shows a secret once: never cached, never stored anywhere on our side."""
    response = page(request, template, context)
    response["Cache-Control"] = "no-store"
    return sealed_once.forget_key(response)


SECRET_SESSION_KEY = "portal_secret_once"


def secret_redirect(request: HttpRequest, to: str, context: dict[str, Any]) -> HttpResponse:
    """POST-redirect-GET for a secret shown once: the POST that minted it parks it in the
    session and redirects, so a reload (or the back button) repeats the harmless GET, never
    the POST that would mint a second one. ``context`` must be JSON-serialisable. The session
    holds it sealed and the browser holds the key (``infra.sealed_once``), so the session
    store never holds a usable secret."""
    return sealed_once.park(request, redirect(to), SECRET_SESSION_KEY, context)


def take_secret(request: HttpRequest) -> dict[str, Any] | None:
    """The parked secret, removed from the session as it is read: shown at most once."""
    return sealed_once.take(request, SECRET_SESSION_KEY)
