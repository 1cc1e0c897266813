"""Admin pages for routes (a public model name over several pools) and tenants' own fallback
orders (docs/adr/0024-routes-and-fairness-across-pools.md)."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from tenants.models import Route, RouteTarget, TenantFallback


class RouteTargetInline(admin.TabularInline):
    model = RouteTarget
    extra = 1
    fields = ["pool", "weight", "priority"]
    autocomplete_fields = ["pool"]


@admin.register(Route)
class RouteAdmin(admin.ModelAdmin):
    list_display = ["name", "target_list", "retries", "fallbacks", "enabled"]
    list_filter = ["enabled"]
    search_fields = ["name"]
    inlines = [RouteTargetInline]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Route]:
        # The targets column reads every row's targets and pools: two queries, not two a row.
        return super().get_queryset(request).prefetch_related("targets__pool")

    @admin.display(description="targets (pool: weight, priority)")
    def target_list(self, obj: Route) -> str:
        return "; ".join(f"{t.pool.name}: {t.weight:g}, p{t.priority}"
                         for t in obj.targets.all())


@admin.register(TenantFallback)
class TenantFallbackAdmin(admin.ModelAdmin):
    list_display = ["tenant", "model", "fallbacks", "updated_at"]
    search_fields = ["tenant__slug", "model"]
    autocomplete_fields = ["tenant"]
