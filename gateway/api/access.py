"""Who may do what through the management API.

- A **management token** acts in its own tenant with its own role, nothing else: it is never
  staff, whoever made it.
- A **signed-in user** acts in a tenant with their membership's role. Being platform staff gives
  no role in any tenant: staff need an active ``StaffGrant`` for that tenant (made in the admin,
  with a reason and an expiry), and then act with the grant's role.
- **Platform actions** (tenants, models, pools, prices, the all-tenant report, quota writes)
  need an active staff account holding the matching Django model permission (``view_``,
  ``add_``, ``change_``, ``delete_``; superusers hold them all).

A tenant the caller has no role in answers 404, the same as one that does not exist, so a
caller cannot probe for other tenants' slugs.
"""

from __future__ import annotations

from typing import Any

from django.db.models import Model
from django.http import Http404
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request

from tenants import roles
from tenants.models import ManagementToken, Membership, StaffGrant, Tenant

ACTION_OF_METHOD = {"GET": "view", "HEAD": "view", "OPTIONS": "view", "POST": "add",
                    "PUT": "change", "PATCH": "change", "DELETE": "delete"}


def token_of(request: Request) -> ManagementToken | None:
    return request.auth if isinstance(request.auth, ManagementToken) else None


def staff_user(request: Request) -> Any | None:
    """The signed-in, active staff user, or None (tokens are never staff)."""
    user = request.user
    if token_of(request) is not None or not getattr(user, "is_authenticated", False):
        return None
    return user if user.is_active and user.is_staff else None


def permission_name(model: type[Model], method: str) -> str:
    action = ACTION_OF_METHOD.get(method.upper(), "change")
    return f"{model._meta.app_label}.{action}_{model._meta.model_name}"


def has_platform_perm(request: Request, model: type[Model], method: str | None = None) -> bool:
    user = staff_user(request)
    return user is not None and user.has_perm(
        permission_name(model, method or request.method or "GET"))


def role_in(request: Request, tenant: Tenant) -> str | None:
    token = token_of(request)
    if token is not None:
        return token.role if token.tenant_id == tenant.pk else None
    uid = request.user.pk
    if uid is None:  # signed out: no memberships
        return None
    role = (Membership.objects.filter(user_id=uid, tenant=tenant)
            .values_list("role", flat=True).first())
    if role is None and staff_user(request) is not None:
        role = (StaffGrant.objects.active().filter(user_id=uid, tenant=tenant)
                .values_list("role", flat=True).first())
    return role


def acts_under_grant(request: Request, tenant: Tenant) -> bool:
    """Is the caller in this tenant only by a ``StaffGrant`` (no membership of their own)?"""
    uid = request.user.pk
    if token_of(request) is not None or staff_user(request) is None or uid is None:
        return False
    return (not Membership.objects.filter(user_id=uid, tenant=tenant).exists()
            and StaffGrant.objects.active().filter(user_id=uid, tenant=tenant).exists())


def refuse_under_grant(request: Request, tenant: Tenant, what: str) -> None:
    """A grant is time-limited support access: it must not mint access that outlives it.

    So whoever acts only by a grant may not invite people, change or remove memberships, or
    issue or rotate API keys (review 3, N5: a grant holder invited themselves as owner and kept
    the tenant after the grant was revoked). Platform staff issue keys through the admin, with
    the permission for it, on the record.
    """
    if acts_under_grant(request, tenant):
        raise PermissionDenied(f"Staff acting under a time-limited grant cannot {what}: it "
                               "would outlast the grant. Ask an owner of the tenant.")


def tenant_ids(request: Request) -> list[int]:
    """The tenants the caller may act in: a token's own, or the user's memberships and grants."""
    token = token_of(request)
    if token is not None:
        return [token.tenant_id]
    uid = request.user.pk
    if uid is None:  # signed out: no memberships
        return []
    ids = set(Membership.objects.filter(user_id=uid).values_list("tenant_id", flat=True))
    if staff_user(request) is not None:
        ids |= set(StaffGrant.objects.active().filter(user_id=uid)
                   .values_list("tenant_id", flat=True))
    return sorted(ids)


def resolve(request: Request, slug: str, capability: str) -> tuple[Tenant, str]:
    tenant = Tenant.objects.filter(slug=slug).first()
    role = role_in(request, tenant) if tenant is not None else None
    if tenant is None or role is None:
        raise Http404("No such tenant.")
    if not roles.can(role, capability):
        raise PermissionDenied(f"The {role} role cannot use this endpoint.")
    return tenant, role


def user_for_audit(request: Request) -> Any:
    """The user to record as the actor (a token records its creator)."""
    token = token_of(request)
    return token.created_by if token is not None else request.user
