"""Rendering with the portal's navigation context."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from gateway.portal.tenancy import context_processor


def page(request: HttpRequest, template: str, context: dict[str, Any] | None = None,
         status: int = 200) -> HttpResponse:
    return render(request, template, {**context_processor(request), **(context or {})},
                  status=status)


def secret_page(request: HttpRequest, template: str, context: dict[str, Any]) -> HttpResponse:
    """A page that shows a secret once: never cached, never stored anywhere on our side."""
    response = page(request, template, context)
    response["Cache-Control"] = "no-store"
    return response
