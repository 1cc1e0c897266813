"""Which tenant an API request acts on, and with which role.

The tenant comes from the URL, but the role comes only from the credential: a management
token's own tenant and role, or the session user's membership (platform staff act as owners).
A tenant the caller has no role in answers 404, the same as one that does not exist, so a
caller cannot probe for other tenants' slugs.
"""

from __future__ import annotations

from typing import Any

from django.http import Http404
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request

from gateway.portal import roles
from gateway.portal.models import ManagementToken
from tenants.models import Membership, Tenant


def token_of(request: Request) -> ManagementToken | None:
    return request.auth if isinstance(request.auth, ManagementToken) else None


def is_admin(request: Request) -> bool:
    return token_of(request) is None and bool(getattr(request.user, "is_staff", False))


def role_in(request: Request, tenant: Tenant) -> str | None:
    token = token_of(request)
    if token is not None:
        return token.role if token.tenant_id == tenant.pk else None
    if is_admin(request):
        return roles.OWNER
    return (
        Membership.objects.filter(user_id=request.user.pk, tenant=tenant)
        .values_list("role", flat=True).first()
    )


def tenant_ids(request: Request) -> list[int] | None:
    """The tenants the caller belongs to; None for platform staff (all of them)."""
    token = token_of(request)
    if token is not None:
        return [token.tenant_id]
    if is_admin(request):
        return None
    return list(Membership.objects.filter(user_id=request.user.pk).values_list("tenant_id",
                                                                               flat=True))


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
