"""Django admin for the catalog: the served models and the routes over their pools
(docs/adr/0024-routes-and-fairness-across-pools.md). The Pool admin shows what the workers
report and checks settings with the engines' rules, so it lives with them (``workers.admin``).
"""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from catalog.models import Route, RouteTarget, ServedModel


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin):
    list_display = ["name", "engine_model_id", "max_model_len", "kv_kib_per_token", "created_at"]
    search_fields = ["name", "engine_model_id"]
    readonly_fields = ["kv_kib_per_token"]

    @admin.display(description="KV cache per token (KiB)")
    def kv_kib_per_token(self, obj: ServedModel) -> str:
        return f"{obj.kv_bytes_per_token / 1024:g}"


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
