"""Sign-in landing, tenant switching."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import LoginView
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import redirect
from django.urls import Resolver404, resolve, reverse
from django.views.decorators.http import require_POST

from gateway.portal.tenancy import NAV, choose, current_membership, section_of
from gateway.portal.views.base import page
from tenants import roles
from tenants.models import ApiKey, Tenant


class PortalLoginView(LoginView):
    """Password sign-in, plus the SSO buttons of a tenant named by ``?tenant=<slug>``."""

    template_name = "portal/login.html"

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        return {**super().get_context_data(**kwargs), "sso": self._sso_buttons()}

    def _sso_buttons(self) -> list[tuple[str, str]]:
        slug = self.request.GET.get("tenant", "")
        tenant = Tenant.objects.filter(slug=slug).first() if slug else None
        if tenant is None:
            return []
        try:  # enterprise sign-in ships separately (gateway.sso); without it, passwords only
            from gateway.sso import sso_login_url, sso_providers_for_tenant
        except ImportError:
            return []
        return [(p.name, sso_login_url(p)) for p in sso_providers_for_tenant(tenant)]


@login_required
def index(request: HttpRequest) -> HttpResponse:
    membership = current_membership(request)
    if membership is None:
        return redirect("portal:no_tenant")
    # Someone who may make keys and has none yet starts on "Get started".
    keys = ApiKey.objects.filter(tenant=membership.tenant)
    if not roles.can(membership.role, "all_keys"):
        keys = keys.filter(created_by_id=request.user.pk)
    if roles.can(membership.role, "keys") and not keys.exists():
        return redirect("portal:overview")
    return redirect("portal:usage" if roles.can(membership.role, "usage") else "portal:keys")


@login_required
def no_tenant(request: HttpRequest) -> HttpResponse:
    return page(request, "portal/no_tenant.html", status=403)


@login_required
@require_POST
def switch(request: HttpRequest) -> HttpResponse:
    try:
        tenant_id = int(request.POST.get("tenant", ""))
    except ValueError:
        return HttpResponseBadRequest("tenant must be a number")
    if not choose(request, tenant_id):
        return HttpResponseBadRequest("You are not a member of that tenant.")
    return redirect(_same_section(request))


def _same_section(request: HttpRequest) -> str:
    """The page the user switched from, in the new tenant: its section's list page (a key or
    export id belongs to the old tenant), if their role there may open it; else the start."""
    try:
        match = resolve(urlsplit(request.POST.get("next", "")).path)
    except Resolver404:
        return reverse("portal:index")
    section = section_of(match.url_name) if match.namespace == "portal" else None
    membership = current_membership(request)
    capability = next((c for name, _, c, _ in NAV if name == section), None)
    if section is None or membership is None or not roles.can(membership.role, capability or ""):
        return reverse("portal:index")
    # The filters of a list page carry over, re-encoded (never the raw text of the field).
    raw = urlsplit(request.POST.get("next", "")).query if match.url_name == section else ""
    query = urlencode(parse_qsl(raw))
    return reverse(f"portal:{section}") + (f"?{query}" if query else "")
