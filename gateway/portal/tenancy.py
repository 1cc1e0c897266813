"""The tenant a portal request acts on, and the role the signed-in user has there.

The tenant comes from the user's own memberships, never from a URL or form field the user
could edit to reach another tenant: the session stores a tenant id, and it is only used if
the user is still a member of it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import update_wrapper
from typing import Any, Concatenate, ParamSpec, cast

from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import AnonymousUser, User
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.shortcuts import redirect

from tenants import roles
from tenants.models import Membership, Tenant

SESSION_KEY = "portal_tenant_id"


class TenantRequest(HttpRequest):
    """A request inside a ``tenant_view``: the signed-in user's membership, its tenant and the
    role it gives. Only the decorator makes one (by setting these on the request it got), so a
    view typed with it can rely on them being there."""

    user: User  # signed in (login_required): never the anonymous user here
    membership: Membership
    tenant: Tenant
    role: str


P = ParamSpec("P")
TenantView = Callable[Concatenate[TenantRequest, P], HttpResponseBase]


def memberships(user: Any) -> list[Membership]:
    return list(Membership.objects.filter(user=user).select_related("tenant").order_by(
        "tenant__name"
    ))


def current_membership(request: HttpRequest) -> Membership | None:
    mine = memberships(request.user)
    chosen = request.session.get(SESSION_KEY)
    for membership in mine:
        if membership.tenant_id == chosen:
            return membership
    return mine[0] if mine else None


def choose(request: HttpRequest, tenant_id: int) -> bool:
    if isinstance(request.user, AnonymousUser):  # no memberships
        return False
    if Membership.objects.filter(user=request.user, tenant_id=tenant_id).exists():
        request.session[SESSION_KEY] = tenant_id
        return True
    return False


def tenant_view(
    capability: str,
) -> Callable[[TenantView[P]], Callable[Concatenate[HttpRequest, P], HttpResponseBase]]:
    """Sign-in required, a membership required, and the role must have ``capability``.

    The view receives a ``TenantRequest``: ``membership``, ``tenant`` and ``role`` are set.
    """

    def decorate(view: TenantView[P]) -> Callable[Concatenate[HttpRequest, P], HttpResponseBase]:
        def wrapper(request: HttpRequest, /, *args: P.args, **kwargs: P.kwargs) -> HttpResponseBase:
            membership = current_membership(request)
            if membership is None:
                return redirect("portal:no_tenant")
            if not roles.can(membership.role, capability):
                raise PermissionDenied(f"Your role ({membership.role}) cannot open this page.")
            bound = cast(TenantRequest, request)
            bound.membership = membership
            bound.tenant = membership.tenant
            bound.role = membership.role
            return view(bound, *args, **kwargs)

        update_wrapper(wrapper, view)
        return login_required(wrapper)

    return decorate


# The navigation: (section's URL name, label, capability, URL names that belong to it). One
# table drives the menu, the "current page" mark and where a tenant switch lands.
NAV: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("overview", "Get started", "overview", ()),
    ("usage", "Usage", "usage", ()),
    ("requests", "Requests", "usage", ()),
    ("keys", "API keys", "keys", ("key_create", "key_created", "key_revoke", "key_rotate",
                                  "key_resume", "key_edit")),
    ("quotas", "Quotas", "quotas", ()),
    ("playground", "Playground", "playground", ()),
    ("reports", "Reports", "reports", ("statement", "export")),
    ("alerts", "Spend alerts", "alerts", ()),
    ("budgets", "Budgets", "budgets", ("projects", "project_edit")),
    ("content_logging", "Content logging", "content_logging", ()),
    ("members", "Members", "members", ()),
    ("tokens", "API tokens", "tokens", ()),
)


def section_of(url_name: str | None) -> str | None:
    for name, _, _, members in NAV:
        if url_name == name or url_name in members:
            return name
    return None


def nav_for(role: str | None, url_name: str | None) -> list[dict[str, Any]]:
    current = section_of(url_name)
    return [{"url_name": name, "label": label, "current": name == current}
            for name, label, capability, _ in NAV if roles.can(role, capability)]


def context_processor(request: HttpRequest) -> dict[str, Any]:
    """Navigation for portal templates (registered by the portal's base view helper)."""
    membership = getattr(request, "membership", None)
    if membership is None and getattr(request, "user", None) is not None \
            and request.user.is_authenticated:
        membership = current_membership(request)  # error pages: keep the menu
    match = getattr(request, "resolver_match", None)
    role = getattr(membership, "role", None)
    return {
        "membership": membership,
        "tenant": getattr(membership, "tenant", None),
        "can": roles.capabilities(role),
        "nav": nav_for(role, match.url_name if match else None) if membership else [],
        "all_memberships": memberships(request.user) if membership else [],
    }
