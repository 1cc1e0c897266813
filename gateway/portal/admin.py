from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from gateway.portal.models import ContentLoggingChange, ManagementToken


@admin.register(ContentLoggingChange)
class ContentLoggingChangeAdmin(admin.ModelAdmin):
    """The audit trail is append-only: nobody edits or deletes it here."""

    list_display = ("changed_at", "tenant", "enabled", "changed_by", "remote_addr")
    list_filter = ("enabled",)
    list_select_related = ("tenant", "changed_by")  # changed_by is nullable: not joined by itself

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(ManagementToken)
class ManagementTokenAdmin(admin.ModelAdmin):
    list_display = ("name", "tenant", "role", "masked", "created_by", "last_used_at",
                    "expires_at", "revoked_at")
    list_filter = ("role",)
    list_select_related = ("tenant", "created_by")  # created_by is nullable
    readonly_fields = ("key_hash", "pepper_version", "prefix", "last_four", "created_by",
                       "last_used_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # tokens are shown once, so they are made where they can be shown: the portal
