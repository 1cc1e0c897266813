"""Playground: a chat request from the browser straight to ``/v1/chat/completions``, streamed.

The browser calls the real inference API with a real key, so what the tenant sees is exactly
what their application will get. The key is pasted in, or the user's short-lived playground
key (``gateway.portal.playground``): one per user and tenant, reused until it nears expiry.
"""

from __future__ import annotations

from django.http import HttpResponse, JsonResponse
from django.views.decorators.http import require_POST

from catalog.visibility import models_for
from gateway.portal.playground import PLAYGROUND_KEY_TTL, playground_key
from gateway.portal.tenancy import TenantRequest, tenant_view
from gateway.portal.views.base import page


@tenant_view("playground")
def playground_page(request: TenantRequest) -> HttpResponse:
    return page(request, "portal/playground.html", {
        "models": models_for(request.tenant),
        "ttl_minutes": int(PLAYGROUND_KEY_TTL.total_seconds() // 60),
    })


@tenant_view("playground")
@require_POST
def playground_key_view(request: TenantRequest) -> HttpResponse:
    found = playground_key(request.session, request.tenant, request.user)
    response = JsonResponse({"key": found.plaintext, "masked": found.key.masked,
                             "expires_at": found.key.expires_at.isoformat(),  # type: ignore[union-attr]
                             "reused": found.reused})
    response["Cache-Control"] = "no-store"
    return response
