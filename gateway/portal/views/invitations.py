"""Opening an invitation link: join as the signed-in user, or create an account, or sign in
(password or the tenant's SSO) and have the sign-in accept it.

The link's secret is kept in the session while the invitee signs in, so the first sign-in,
through SSO included, accepts the invitation (``accept_pending_on_sign_in``).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth import login
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.urls import reverse

from gateway.portal.forms import AcceptInvitationForm
from gateway.portal.tenancy import SESSION_KEY as TENANT_SESSION_KEY
from gateway.portal.views.base import page
from gateway.sso import sso_login_url, sso_providers_for_tenant
from tenants import invitations
from tenants.models import Invitation

PENDING_KEY = "portal_pending_invitation"
MODEL_BACKEND = "django.contrib.auth.backends.ModelBackend"


def invitation_page(request: HttpRequest, secret: str) -> HttpResponse:
    found = invitations.find(secret)
    if found is not None and request.user.is_authenticated and \
            found.accepted_by_id == request.user.pk:
        return _joined(request, found)  # accepted by this sign-in already
    invitation = invitations.pending(secret)
    if invitation is None:
        request.session.pop(PENDING_KEY, None)
        # Whoever holds the link may learn why it stopped working (it names nothing else).
        return page(request, "portal/invitation_invalid.html", {"found": found}, status=404)
    if request.user.is_authenticated:
        return _join_as_signed_in(request, secret, invitation)
    return _join_as_new(request, secret, invitation)


def _join_as_signed_in(request: HttpRequest, secret: str, invitation: Invitation) -> HttpResponse:
    if request.method == "POST":
        return _accept(request, secret, request.user)
    return page(request, "portal/invitation.html", {"invitation": invitation})


def _join_as_new(request: HttpRequest, secret: str, invitation: Invitation) -> HttpResponse:
    request.session[PENDING_KEY] = secret  # a sign-in from here accepts it
    form = AcceptInvitationForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            membership = invitations.accept_with_new_account(
                secret, form.cleaned_data["username"], form.cleaned_data["password1"])
        except invitations.InvitationInvalid:
            return page(request, "portal/invitation_invalid.html", status=404)
        request.session.pop(PENDING_KEY, None)
        login(request, membership.user, backend=MODEL_BACKEND)
        messages.info(request, f"Your username is {membership.user.get_username()}.")
        return _joined(request, invitation)
    here = reverse("portal:invitation", args=[secret])
    return page(request, "portal/invitation.html", {
        "invitation": invitation, "form": form, "sso": _sso_buttons(invitation, here),
        "login_url": f"{reverse('portal:login')}?{urlencode({'next': here})}",
    })


def _accept(request: HttpRequest, secret: str, user: Any) -> HttpResponse:
    try:
        invitations.accept(secret, user)
    except invitations.InvitationInvalid:
        return page(request, "portal/invitation_invalid.html", status=404)
    request.session.pop(PENDING_KEY, None)
    found = invitations.find(secret)
    assert found is not None
    return _joined(request, found)


def _joined(request: HttpRequest, invitation: Invitation) -> HttpResponse:
    request.session[TENANT_SESSION_KEY] = invitation.tenant_id
    messages.success(request, f"Welcome to {invitation.tenant.name}.")
    return redirect("portal:index")


def _sso_buttons(invitation: Invitation, next_url: str) -> list[tuple[str, str]]:
    return [(p.name, f"{sso_login_url(p)}?{urlencode({'next': next_url})}")
            for p in sso_providers_for_tenant(invitation.tenant)]


def accept_pending_on_sign_in(sender: Any, request: HttpRequest | None, user: Any,
                              **kwargs: Any) -> None:
    """``user_logged_in``: a sign-in that started from an invitation link accepts it."""
    if request is None or not hasattr(request, "session"):
        return
    secret = request.session.pop(PENDING_KEY, None)
    if not secret:
        return
    try:
        membership = invitations.accept(secret, user)
    except invitations.InvitationInvalid:
        return
    request.session[TENANT_SESSION_KEY] = membership.tenant_id
