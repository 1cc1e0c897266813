"""Admin page for tenants' own fallback orders (docs/adr/0024-routes-and-fairness-across-pools.md;
the routes themselves: ``catalog.admin``)."""

from __future__ import annotations

from django.contrib import admin

from tenants.models import TenantFallback


@admin.register(TenantFallback)
class TenantFallbackAdmin(admin.ModelAdmin):
    list_display = ["tenant", "model", "fallbacks", "updated_at"]
    search_fields = ["tenant__slug", "model"]
    autocomplete_fields = ["tenant"]
