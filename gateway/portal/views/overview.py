"""Getting started: the base URL, the user's keys, the models they may use with today's price,
and first-request snippets filled with all of it."""

from __future__ import annotations

from django.http import HttpResponse
from django.utils import timezone

from catalog.visibility import models_for
from gateway.portal.snippets import base_url, snippets
from gateway.portal.tenancy import TenantRequest, tenant_view
from gateway.portal.views.base import page
from gateway.portal.views.keys import visible_keys
from metering.billing.pricing import PriceBook
from tenants import roles


@tenant_view("overview")
def overview_page(request: TenantRequest) -> HttpResponse:
    now = timezone.now()
    models = list(models_for(request.tenant))
    book = PriceBook(m.name for m in models)
    rows = [(m, book.at(m.name, now)) for m in models]
    keys = list(visible_keys(request).usable(now)) if roles.can(request.role, "keys") else []
    base = base_url(request)
    example = models[0].name if models else "MODEL"
    return page(request, "portal/overview.html", {
        "base_url": base, "models": rows, "keys": keys, "now": now,
        "snippets": snippets(base, example), "example_model": example,
    })

