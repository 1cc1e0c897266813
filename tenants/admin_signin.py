"""Admin for enterprise sign-in: identity providers (OIDC) and client-certificate bindings.

The SSO client secret is write-only: the form never renders it, and leaving the field empty
keeps the stored one.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.http import HttpRequest

from tenants.models import ClientCertificate, IdentityProvider


class IdentityProviderForm(forms.ModelForm):
    sso_client_secret = forms.CharField(
        required=False, widget=forms.PasswordInput(render_value=False),
        help_text="Write-only. Leave empty to keep the current secret.",
    )

    class Meta:
        model = IdentityProvider
        fields = "__all__"

    def clean_sso_client_secret(self) -> str:
        value = self.cleaned_data.get("sso_client_secret", "")
        return value or (self.instance.sso_client_secret if self.instance.pk else "")


@admin.register(IdentityProvider)
class IdentityProviderAdmin(admin.ModelAdmin):
    form = IdentityProviderForm
    list_display = ["name", "tenant", "issuer", "audience", "api_enabled", "sso_enabled"]
    list_filter = ["api_enabled", "sso_enabled"]
    list_select_related = ["tenant"]
    search_fields = ["name", "issuer", "audience", "tenant__slug"]
    autocomplete_fields = ["tenant"]


@admin.register(ClientCertificate)
class ClientCertificateAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "fingerprint_sha256", "expires_at", "revoked_at"]
    list_select_related = ["tenant"]
    search_fields = ["name", "fingerprint_sha256", "tenant__slug"]
    autocomplete_fields = ["tenant"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # A binding's fingerprint never changes: bind a new certificate, revoke the old one.
        return ["fingerprint_sha256"] if obj else []
