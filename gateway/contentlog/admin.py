"""Admin for the content log: metadata only. No page renders a ciphertext or a plaintext.

Records, keys and audit entries are read-only; grants are created through /breakglass/ and
decided by admin actions that go through ``breakglass`` (so every decision is audited).
"""

from __future__ import annotations

from typing import Any, TypeVar

from django.contrib import admin, messages
from django.db.models import Model, OuterRef, QuerySet, Subquery
from django.http import HttpRequest

from gateway.contentlog import breakglass
from gateway.contentlog.models import AuditEntry, BreakGlassGrant, ContentRecord, TenantKey
from tenants.models import Tenant

_M = TypeVar("_M", bound=Model)


class ReadOnlyAdmin(admin.ModelAdmin[_M]):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


RECORD_FIELDS: tuple[str, ...] = ("id", "tenant", "request_id", "created_at", "expires_at",
                                  "key_version")
KEY_FIELDS: tuple[str, ...] = ("tenant", "version", "active", "master_kid", "created_at")


@admin.register(ContentRecord)
class ContentRecordAdmin(ReadOnlyAdmin[ContentRecord]):
    list_display = ["request_id", "tenant", "created_at", "expires_at", "key_version"]
    list_filter = ["tenant"]
    list_select_related = ["tenant"]
    fields = readonly_fields = RECORD_FIELDS
    show_full_result_count = False  # no COUNT(*) over a large table

    def get_queryset(self, request: HttpRequest) -> QuerySet[ContentRecord]:
        return super().get_queryset(request).defer("ciphertext")


@admin.register(TenantKey)
class TenantKeyAdmin(ReadOnlyAdmin[TenantKey]):
    list_display = ["tenant", "version", "active", "master_kid", "created_at"]
    list_select_related = ["tenant"]
    fields = readonly_fields = KEY_FIELDS


class AuditTenantFilter(admin.SimpleListFilter):
    """Audit rows keep a bare tenant id (they outlive the tenant); filter by its name."""

    title = "tenant"
    parameter_name = "tenant_id"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(str(pk), name) for pk, name in Tenant.objects.order_by("name")
                .values_list("pk", "name")]

    def queryset(self, request: HttpRequest,
                 queryset: QuerySet[AuditEntry]) -> QuerySet[AuditEntry]:
        tenant_id = self.value()
        return queryset.filter(tenant_id=tenant_id) if tenant_id else queryset


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin[AuditEntry]):
    list_display = ["created_at", "actor_username", "action", "tenant_name", "grant_id",
                    "request_id"]
    list_filter = ["action", AuditTenantFilter]

    def get_queryset(self, request: HttpRequest) -> QuerySet[AuditEntry]:
        name = Tenant.objects.filter(pk=OuterRef("tenant_id")).values("name")[:1]
        return super().get_queryset(request).annotate(_tenant_name=Subquery(name))

    @admin.display(description="tenant", ordering="tenant_id")
    def tenant_name(self, obj: AuditEntry) -> str:
        return getattr(obj, "_tenant_name", None) or f"(deleted tenant #{obj.tenant_id})"
    search_fields = ["actor_username", "request_id"]
    readonly_fields = [f.name for f in AuditEntry._meta.fields]


@admin.register(BreakGlassGrant)
class BreakGlassGrantAdmin(ReadOnlyAdmin[BreakGlassGrant]):
    list_display = ["pk", "tenant", "requested_by", "state", "approved_by", "self_approved",
                    "records_from", "records_until", "access_until"]
    list_filter = ["state", "self_approved", "tenant"]
    list_select_related = ["tenant", "requested_by", "approved_by"]
    readonly_fields = [f.name for f in BreakGlassGrant._meta.fields]
    actions = ["approve_selected", "deny_selected"]

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # The actions need "change" to be offered; fields stay read-only.
        return request.user.has_perm(breakglass.APPROVE_PERM)

    @admin.action(description="Approve selected break-glass requests", permissions=["change"])
    def approve_selected(self, request: HttpRequest, queryset: QuerySet[BreakGlassGrant]) -> None:
        self._decide(request, queryset, breakglass.approve)

    @admin.action(description="Deny selected break-glass requests", permissions=["change"])
    def deny_selected(self, request: HttpRequest, queryset: QuerySet[BreakGlassGrant]) -> None:
        self._decide(request, queryset, breakglass.deny)

    def _decide(self, request: HttpRequest, queryset: QuerySet[BreakGlassGrant], fn: Any) -> None:
        for grant in queryset:
            try:
                fn(grant, request.user)
            except (breakglass.BreakGlassDenied, ValueError) as exc:
                self.message_user(request, f"grant {grant.pk}: {exc}", messages.ERROR)
            else:
                self.message_user(request, f"grant {grant.pk}: done", messages.SUCCESS)
