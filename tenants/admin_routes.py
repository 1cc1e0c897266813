"""Admin pages for routes (a public model name over several pools) and tenants' own fallback
orders (docs/adr/0024-routes-and-fairness-across-pools.md)."""

from __future__ import annotations

from django.contrib import admin

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

    @admin.display(description="targets (pool: weight, priority)")
    def target_list(self, obj: Route) -> str:
        return "; ".join(f"{t.pool.name}: {t.weight:g}, p{t.priority}"
                         for t in obj.targets.select_related("pool"))


@admin.register(TenantFallback)
class TenantFallbackAdmin(admin.ModelAdmin):
    list_display = ["tenant", "model", "fallbacks", "updated_at"]
    search_fields = ["tenant__slug", "model"]
    autocomplete_fields = ["tenant"]
