"""The request log page: the tenant's recent requests, refusals included, with filters."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

from django.http import HttpResponse
from django.utils import timezone

from gateway.portal.tenancy import TenantRequest, tenant_view
from gateway.portal.views.base import page
from gateway.portal.views.keys import visible_keys
from gateway.portal.views.usage import own_key_ids
from metering.billing.pricing import PriceBook
from metering.models import RequestLogEntry
from tenants.models import Project

SHOWN = 200
RANGES = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7)}
STATUSES = ("ok", "refused", "cancelled", "error", "expired")


@tenant_view("usage")
def request_log_page(request: TenantRequest) -> HttpResponse:
    params = request.GET
    span = params.get("range") or "24h"
    span = span if span in RANGES else "24h"
    qs = RequestLogEntry.objects.filter(tenant=request.tenant,
                                        at__gte=timezone.now() - RANGES[span])
    key_ids = own_key_ids(request)
    if key_ids is not None:
        qs = qs.filter(api_key_id__in=key_ids)
    # A filter value that is not one of the choices is ignored, never an error page.
    if params.get("status") in STATUSES:
        qs = qs.filter(status=params["status"])
    for param, field in (("code", "error_code"), ("model", "model_name"),
                         ("end_user", "end_user")):
        if params.get(param):
            qs = qs.filter(**{field: params[param][:256]})
    if (params.get("key") or "").isdigit():
        qs = qs.filter(api_key_id=int(params["key"]))
    if (params.get("project") or "").isdigit():
        qs = qs.filter(project_id=int(params["project"]))
    counts = Counter(qs.values_list("status", flat=True)[:10_000])
    entries = list(qs.select_related("api_key").order_by("-at", "-id")[:SHOWN])
    prices = PriceBook({e.model_name for e in entries})
    projects = dict(Project.objects.filter(tenant=request.tenant).values_list("pk", "name"))
    for entry in entries:
        entry.project_name = projects.get(entry.project_id or 0, "")  # type: ignore[attr-defined]
    for entry in entries:
        cost, currency = (prices.cost(entry.model_name, entry.at, entry.prompt_tokens,
                                      entry.cached_tokens, entry.completion_tokens)
                          if entry.status != "refused" else (None, ""))
        entry.cost, entry.currency = cost, currency  # type: ignore[attr-defined]
    return page(request, "portal/requests.html", {
        "entries": entries, "shown": SHOWN, "span": span, "ranges": list(RANGES),
        "statuses": STATUSES, "counts": [(s, counts.get(s, 0)) for s in STATUSES],
        "keys": visible_keys(request).order_by("name"),
        "projects": sorted(projects.items(), key=lambda p: p[1]),
        "filters": {k: params.get(k, "") for k in ("status", "code", "model", "end_user", "key",
                                                   "project")},
        "scoped_to_own_keys": key_ids is not None,
    })
