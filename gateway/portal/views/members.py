"""Members of the tenant: add by username or email, change roles, remove. Owners only."""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from gateway.portal import membership
from gateway.portal.forms import MemberForm
from gateway.portal.tenancy import TenantRequest, tenant_view
from gateway.portal.views.base import page
from tenants.models import Membership


@tenant_view("members")
def members_page(request: TenantRequest) -> HttpResponse:
    tenant = request.tenant
    form = MemberForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            membership.add(tenant, form.cleaned_data["user"], form.cleaned_data["role"])
        except ValidationError as exc:
            form.add_error(None, exc.messages[0])
        else:
            messages.success(request, "Member added.")
            return redirect("portal:members")
    members = Membership.objects.filter(tenant=tenant).select_related("user").order_by("id")
    return page(request, "portal/members.html", {"form": form, "members": members,
                                                 "roles": Membership.Role.choices})


@tenant_view("members")
@require_POST
def member_change(request: TenantRequest, pk: int) -> HttpResponse:
    target = get_object_or_404(Membership, pk=pk, tenant=request.tenant)
    role = request.POST.get("role", "")
    try:
        if role == "remove":
            membership.remove(target)
        elif role in Membership.Role.values:
            membership.change_role(target, role)
    except ValidationError as exc:
        messages.error(request, exc.messages[0])
    return redirect("portal:members")
