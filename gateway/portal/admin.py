
from django.contrib import admin
from django.http import HttpRequest

from gateway.portal.models import ManagementToken


@admin.register(ManagementToken)
class ManagementTokenAdmin(admin.ModelAdmin):
    list_display = ("name", "tenant", "role", "masked", "created_by", "last_used_at",
                    "expires_at", "revoked_at")
    list_filter = ("role",)
    list_select_related = ("tenant", "created_by")
    readonly_fields = ("key_hash", "pepper_version", "prefix", "last_four", "created_by",
                       "last_used_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # tokens are shown once, so they are made where they can be shown: the portal
