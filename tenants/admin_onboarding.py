"""Onboarding from the admin: a tenant and the invitation of its first owner in one step, and
an account made without a password gets a set-password link instead of being left unable to
sign in (the portal's "Forgot password" deliberately skips accounts without a usable password:
those are SSO accounts, whose password is the provider's)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin
from django.contrib.auth.tokens import default_token_generator
from django.core.exceptions import ValidationError
from django.core.mail import send_mail
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.encoding import force_bytes
from django.utils.http import urlsafe_base64_encode

from tenants import invitations
from tenants.models import Tenant

User = get_user_model()


class TenantOnboardingForm(forms.ModelForm):  # type: ignore[type-arg]
    first_owner_email = forms.EmailField(
        required=False, label="Invite its first owner",
        help_text="Email address: they get an invitation link to join as owner (and to create "
                  "an account if they have none). Leave empty to add members later.")

    class Meta:
        model = Tenant
        fields = "__all__"


class TenantOnboardingMixin(admin.ModelAdmin):  # type: ignore[type-arg]
    """The tenant add page also invites the first owner by email."""

    def get_form(self, request: HttpRequest, obj: Any = None, change: bool = False,
                 **kwargs: Any) -> Any:
        if obj is None:
            kwargs["form"] = TenantOnboardingForm
        return super().get_form(request, obj, change=change, **kwargs)

    def save_model(self, request: HttpRequest, obj: Tenant, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        email = form.cleaned_data.get("first_owner_email") if not change else ""
        if not email:
            return
        try:
            invitations.invite(obj, email, "owner", request.user, link_for=lambda secret: (
                request.build_absolute_uri(reverse("portal:invitation", args=[secret]))))
        except ValidationError as exc:  # the tenant stays; the invitation can be sent again
            messages.error(request, f"Tenant saved, but no invitation: {'; '.join(exc.messages)}")
            return
        messages.success(request, f"Invitation to be the owner sent to {email}.")


def send_set_password_link(request: HttpRequest, user: Any) -> None:
    """Email ``user`` the portal's set-a-new-password link (the reset flow's own link)."""
    uid = urlsafe_base64_encode(force_bytes(user.pk))
    token = default_token_generator.make_token(user)
    link = request.build_absolute_uri(reverse("portal:password_reset_confirm", kwargs={
        "uidb64": uid, "token": token}))
    send_mail(subject="Your inference gateway account",
              message=(f"An account {user.get_username()} was made for you on the inference "
                       f"gateway.\n\nChoose your password: {link}\n\nThe link works once.\n"),
              from_email=None, recipient_list=[user.email])


class OnboardingUserAdmin(UserAdmin):  # type: ignore[type-arg]
    actions = ["send_set_password_links"]

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        if not change and not obj.has_usable_password():
            self._offer_password(request, obj)

    def _offer_password(self, request: HttpRequest, user: Any) -> None:
        if not user.email:
            messages.warning(request, f"{user.get_username()} has no password and no email: "
                                      "they cannot sign in until you set one (or use SSO).")
            return
        try:
            send_set_password_link(request, user)
        except OSError:
            messages.error(request, f"The set-password email to {user.email} failed.")
            return
        messages.success(request, f"A set-password link was sent to {user.email}.")

    @admin.action(description="Email a set-password link to the selected users",
                  permissions=["change"])
    def send_set_password_links(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        for user in queryset.filter(is_active=True):
            self._offer_password(request, user)


admin.site.unregister(User)
admin.site.register(User, OnboardingUserAdmin)
