"""Members of the tenant: invite by email, change roles, remove. Owners only.

Anything that takes the owner role away from someone asks first; the last owner can never lose
it (``tenants.membership``).
"""

from __future__ import annotations

from datetime import timedelta

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from gateway.portal.forms import InviteForm
from gateway.portal.tenancy import TenantRequest, tenant_view
from gateway.portal.views.base import page
from tenants import invitations, membership
from tenants.models import Invitation, Membership
from tenants.roles import OWNER

EXPIRED_SHOWN = timedelta(days=30)


def invitation_link(request: HttpRequest, secret: str) -> str:
    return request.build_absolute_uri(reverse("portal:invitation", args=[secret]))


@tenant_view("members")
def members_page(request: TenantRequest) -> HttpResponse:
    tenant = request.tenant
    form = InviteForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        email = form.cleaned_data["email"]
        try:
            invitations.invite(tenant, email, form.cleaned_data["role"], request.user,
                               lambda secret: invitation_link(request, secret))
        except ValidationError as exc:
            form.add_error(None, exc.messages[0])
        else:
            messages.success(request, f"Invitation sent to {email}. The link works once.")
            return redirect("portal:members")
    members = list(Membership.objects.filter(tenant=tenant).select_related("user").order_by("id"))
    owners = sum(m.role == OWNER for m in members)
    pending = Invitation.objects.filter(tenant=tenant).pending().select_related("invited_by")
    # Expired in the last month and never replaced: listed with Resend, not silently gone.
    now = timezone.now()
    expired = (Invitation.objects.filter(
        tenant=tenant, accepted_at__isnull=True, revoked_at__isnull=True,
        expires_at__lte=now, expires_at__gt=now - EXPIRED_SHOWN)
        .exclude(email__in=pending.values("email")).select_related("invited_by"))
    return page(request, "portal/members.html", {
        "form": form, "members": members, "roles": Membership.Role.choices,
        "last_owner_ids": {m.pk for m in members if m.role == OWNER and owners == 1},
        "pending": pending, "expired": expired,
    })


# "remove_revoke" also revokes every API key the member created here (review 3).
REMOVE = ("remove", "remove_revoke")


def _needs_confirmation(request: HttpRequest, target: Membership, role: str) -> bool:
    takes_owner = target.role == OWNER and role != OWNER
    leaves = role in REMOVE and target.user_id == request.user.pk
    return (takes_owner or leaves) and request.POST.get("confirm") != "yes"


@tenant_view("members")
@require_POST
def member_change(request: TenantRequest, pk: int) -> HttpResponse:
    target = get_object_or_404(Membership.objects.select_related("user"), pk=pk,
                               tenant=request.tenant)
    role = request.POST.get("role", "")
    if role not in REMOVE and role not in Membership.Role.values:
        messages.error(request, "Choose a role, or remove.")
        return redirect("portal:members")
    if membership.is_last_owner(target) and role != OWNER:
        messages.error(request, f"{target.user.get_username()} is the last owner. "
                                "Make someone else an owner first.")
        return redirect("portal:members")
    if _needs_confirmation(request, target, role):
        return page(request, "portal/member_confirm.html", {
            "target": target, "role": role, "self": target.user_id == request.user.pk,
            "removes": role in REMOVE})
    try:
        if role in REMOVE:
            kept = membership.remove(target, revoke_keys=role == "remove_revoke")
            if kept and target.user_id != request.user.pk:
                # The rule for a removed member's keys, said where the owner acts.
                messages.info(request, f"{kept} API key(s) {target.user.get_username()} created "
                                       "still work: they are the tenant's. Revoke them on the "
                                       "API keys page if they should stop.")
        else:
            membership.change_role(target, role)
    except ValidationError as exc:
        messages.error(request, exc.messages[0])
        return redirect("portal:members")
    if target.user_id == request.user.pk and role != OWNER:
        messages.success(request, "Your role changed. Members are managed by the owners now.")
        return redirect("portal:index")  # the members page is for owners only
    messages.success(request, "Membership updated.")
    return redirect("portal:members")


@tenant_view("members")
@require_POST
def invitation_resend(request: TenantRequest, pk: int) -> HttpResponse:
    """A new link to the same address and role; the old one (pending or expired) stops."""
    old = get_object_or_404(Invitation, pk=pk, tenant=request.tenant, accepted_at__isnull=True,
                            revoked_at__isnull=True)
    invitations.revoke(old)
    try:
        invitations.invite(request.tenant, old.email, old.role, request.user,
                           lambda secret: invitation_link(request, secret))
    except ValidationError as exc:
        messages.error(request, exc.messages[0])
    else:
        messages.success(request, f"A new invitation was sent to {old.email}.")
    return redirect("portal:members")


@tenant_view("members")
@require_POST
def invitation_revoke(request: TenantRequest, pk: int) -> HttpResponse:
    invitation = get_object_or_404(Invitation, pk=pk, tenant=request.tenant)
    invitations.revoke(invitation)
    messages.success(request, f"Invitation to {invitation.email} revoked.")
    return redirect("portal:members")
