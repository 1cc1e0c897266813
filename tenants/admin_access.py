"""Admin for who may act in a tenant: staff grants, invitations, management tokens and the
content-logging audit trail."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django import forms
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.http import HttpRequest
from django.utils import timezone

from tenants.models import ContentLoggingChange, Invitation, ManagementToken, StaffGrant


def _in_eight_hours() -> Any:
    return timezone.now() + timedelta(hours=8)


class StaffGrantForm(forms.ModelForm):
    class Meta:
        model = StaffGrant
        fields = ["user", "tenant", "role", "reason", "expires_at", "revoked_at"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        staff = get_user_model().objects.filter(is_staff=True, is_active=True)
        self.fields["user"].queryset = staff  # type: ignore[attr-defined]  # a ModelChoiceField
        if not self.instance.pk:
            self.fields["expires_at"].initial = _in_eight_hours


@admin.register(StaffGrant)
class StaffGrantAdmin(admin.ModelAdmin):
    """Granting support access to a tenant: who, where, which role, why, until when."""

    form = StaffGrantForm
    list_display = ["user", "tenant", "role", "reason", "granted_by", "created_at", "expires_at",
                    "revoked_at"]
    list_filter = ["role", "tenant"]
    list_select_related = ["user", "tenant", "granted_by"]
    search_fields = ["user__username", "tenant__slug", "reason"]
    autocomplete_fields = ["tenant"]

    def save_model(self, request: HttpRequest, obj: StaffGrant, form: Any, change: bool) -> None:
        if not change:
            # The admin only serves signed-in staff, so this is never AnonymousUser.
            obj.granted_by = request.user  # type: ignore[assignment]
        super().save_model(request, obj, form, change)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # revoke instead: the grant stays on record


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin):
    list_display = ["email", "tenant", "role", "invited_by", "created_at", "expires_at",
                    "accepted_at", "revoked_at"]
    list_select_related = ["tenant", "invited_by"]
    search_fields = ["email", "tenant__slug"]
    readonly_fields = ["tenant", "email", "role", "invited_by", "expires_at", "accepted_at",
                       "accepted_by"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # owners invite from the portal, where the link is emailed


@admin.register(ContentLoggingChange)
class ContentLoggingChangeAdmin(admin.ModelAdmin):
    """The audit trail is append-only: nobody edits or deletes it here."""

    list_display = ("changed_at", "tenant", "enabled", "changed_by", "remote_addr")
    list_filter = ("enabled", "tenant")
    list_select_related = ("tenant", "changed_by")

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
    list_filter = ("role", "tenant")
    list_select_related = ("tenant", "created_by")
    readonly_fields = ("key_hash", "pepper_version", "prefix", "last_four", "created_by",
                       "last_used_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # tokens are shown once, so they are made where they can be shown: the portal
