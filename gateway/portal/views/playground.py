"""Playground: a chat request from the browser straight to ``/v1/chat/completions``, streamed.

The browser calls the real inference API with a real key, so what the tenant sees is exactly
what their application will get. The key is pasted in, or minted here for one hour; either way
it lives only in the page's memory.
"""

from __future__ import annotations

from datetime import timedelta

from django.http import HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.http import require_POST

from gateway.portal.forms import models_for
from gateway.portal.tenancy import TenantRequest, tenant_view
from gateway.portal.views.base import page
from tenants.keys import issue_key

PLAYGROUND_KEY_TTL = timedelta(hours=1)


@tenant_view("playground")
def playground_page(request: TenantRequest) -> HttpResponse:
    return page(request, "portal/playground.html", {
        "models": models_for(request.tenant),
        "ttl_minutes": int(PLAYGROUND_KEY_TTL.total_seconds() // 60),
    })


@tenant_view("playground")
@require_POST
def playground_key(request: TenantRequest) -> HttpResponse:
    key, plaintext = issue_key(
        request.tenant, "playground", created_by=request.user,
        expires_at=timezone.now() + PLAYGROUND_KEY_TTL,
    )
    response = JsonResponse({"key": plaintext, "masked": key.masked,
                             "expires_at": key.expires_at.isoformat()})
    response["Cache-Control"] = "no-store"
    return response
