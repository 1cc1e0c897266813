"""Admin for usage records and hourly rollups: read-only, and never deletable (billing data).

The raw table holds a row per request, so its changelist must never run ``COUNT(*)``:
``CappedCountPaginator`` counts at most ``CAP`` rows (a bounded ``LIMIT`` subquery) and the
changelist skips the unfiltered full count.
"""

from __future__ import annotations

from typing import TypeVar

from django.contrib import admin
from django.core.paginator import Paginator
from django.db.models import Model, QuerySet
from django.utils.functional import cached_property

from metering.admin_fairness import FairnessAdminMixin
from metering.models import UsageRecord, UsageRollup


class CappedCountPaginator(Paginator[Model]):
    CAP = 10_000

    @cached_property
    def count(self) -> int:
        rows = self.object_list
        if not isinstance(rows, QuerySet):  # a list: no table to bound
            return len(rows)
        # SELECT COUNT(*) FROM (SELECT ... LIMIT CAP): bounded work whatever the table size.
        return rows[: self.CAP].count()


_M = TypeVar("_M", bound=Model)


class _ReadOnly(admin.ModelAdmin[_M]):
    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: object, obj: object = None) -> bool:
        return False  # statements are built from these rows: they are never deleted by hand


class TenantFilter(admin.RelatedFieldListFilter):
    """Tenants by name (from the tenant table, not a DISTINCT over millions of usage rows)."""


def counted(field: str, label: str | None = None):  # type: ignore[no-untyped-def]
    """A list column showing ``field`` with thousands separators, still sortable."""

    @admin.display(description=label or field.replace("_", " "), ordering=field)
    def show(obj: object) -> str:
        value = getattr(obj, field)
        return "" if value is None else f"{value:,}"

    show.__name__ = f"{field}_display"
    return show


@admin.register(UsageRecord)
class UsageRecordAdmin(FairnessAdminMixin, _ReadOnly[UsageRecord]):
    # The columns a 1366 px screen shows without a sideways scroll; a row's page has the rest
    # (request id, pool, cached tokens, total time, finish reason).
    list_display = ("finished_at", "tenant", "api_key", "model_name",
                    counted("prompt_tokens", "input"), counted("completion_tokens", "output"),
                    counted("ttft_ms", "TTFT ms"), "status")
    list_display_links = ("finished_at",)
    list_filter = (("tenant", TenantFilter), "status", "model_name")
    list_select_related = ("tenant", "api_key")
    search_fields = ("=request_id",)
    ordering = ("-id",)
    paginator = CappedCountPaginator
    show_full_result_count = False
    list_per_page = 100


@admin.register(UsageRollup)
class UsageRollupAdmin(_ReadOnly[UsageRollup]):
    list_display = ("hour", "tenant", "api_key", "model_name", counted("requests"),
                    counted("errors"), counted("prompt_tokens"), counted("cached_tokens"),
                    counted("completion_tokens"))
    list_filter = (("tenant", TenantFilter), "model_name")
    list_select_related = ("tenant", "api_key")
    date_hierarchy = "hour"
    ordering = ("-hour",)
    paginator = CappedCountPaginator
    show_full_result_count = False
