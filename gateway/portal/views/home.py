"""Sign-in landing, tenant switching."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import LoginView
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from gateway.portal.tenancy import choose, current_membership
from gateway.portal.views.base import page
from tenants import roles
from tenants.models import Tenant


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
    return redirect("portal:index")
