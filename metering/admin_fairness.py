"""The admin's fairness page: per pool, live, what each tenant received against its share.

``/admin/metering/usagerecord/fairness/`` shows ``metering.fairness`` figures (the ones exported
as ``igw_fair_*``) per pool: a table per tenant, a bar chart of service share against weighted
share, and a line chart of each tenant's share ratio that grows as the page polls
``fairness/data/`` every few seconds. Staff with the usage-record view permission only.
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.response import TemplateResponse
from django.urls import path

from infra.redis_conn import get_redis
from metering import fairness
from metering.keys import pool_names
from tenants.models import Tenant

POLL_MS = 5000


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def snapshot() -> dict[str, Any]:
    """Every pool's figures now, tenants by slug (the data endpoint's JSON)."""
    r = get_redis()
    slugs = {str(pk): slug for pk, slug in Tenant.objects.values_list("pk", "slug")}
    pools = []
    for pool in pool_names(r):
        pf = fairness.figures(r, pool)
        tenants = [{
            "tenant": slugs.get(tid, tid), "weight": f.weight, "backlogged": f.backlogged,
            "service": round(f.service, 1), "service_share": round(f.service_share, 4),
            "weighted_share": round(f.weighted_share, 4),
            "share_ratio": None if f.share_ratio is None else round(f.share_ratio, 3),
            "below_share": bool(f.backlogged and (f.share_ratio or 0) < 0.8),
            "queue_wait_p95_s": f.queue_wait_p95_s, "ttft_p95_s": f.ttft_p95_s,
            "uncontended_ttft_p95_s": f.uncontended_ttft_p95_s,
            "ttft_slowdown": None if f.ttft_slowdown is None else round(f.ttft_slowdown, 2),
        } for tid, f in pf.tenants.items()]
        pools.append({"pool": pool, "total_service": round(pf.total_service, 1),
                      "max_service_diff": round(pf.max_service_diff, 1), "tenants": tenants})
    return {"at": time.time(), "pools": pools}


class FairnessAdminMixin:
    """Adds the fairness page and its data endpoint to a ModelAdmin (the usage records')."""

    def get_urls(self) -> list[Any]:
        wrap = self.admin_site.admin_view  # type: ignore[attr-defined]
        return [
            path("fairness/", wrap(self.fairness_view), name="metering_fairness"),
            path("fairness/data/", wrap(self.fairness_data), name="metering_fairness_data"),
            *super().get_urls(),  # type: ignore[misc]
        ]

    def _check(self, request: HttpRequest) -> None:
        if not self.has_view_permission(request):  # type: ignore[attr-defined]
            raise PermissionDenied

    def fairness_view(self, request: HttpRequest) -> HttpResponse:
        self._check(request)
        context = {
            **self.admin_site.each_context(request),  # type: ignore[attr-defined]
            "opts": self.opts,  # type: ignore[attr-defined]
            "title": "Fairness per pool",
            "data": snapshot(), "poll_ms": POLL_MS,
            "window_s": settings.FAIRNESS_WINDOW_SECONDS,
        }
        return TemplateResponse(request, "admin/metering/fairness.html", context)

    def fairness_data(self, request: HttpRequest) -> JsonResponse:
        self._check(request)
        return JsonResponse(snapshot())
