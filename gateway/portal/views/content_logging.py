"""The content-logging opt-in: what is stored, the switch, and who switched it when."""

from __future__ import annotations

from django.apps import apps
from django.conf import settings
from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import redirect

from gateway.portal.forms import ContentLoggingForm
from gateway.portal.tenancy import TenantRequest, tenant_view
from gateway.portal.views.base import page
from tenants.content_logging import switch
from tenants.models import ContentLoggingChange, Tenant


@tenant_view("content_logging")
def content_logging_page(request: TenantRequest) -> HttpResponse:
    tenant = request.tenant
    form = ContentLoggingForm(request.POST or None, initial={"enabled": tenant.content_logging})
    if request.method == "POST" and form.is_valid():
        enabled = form.cleaned_data["enabled"]
        if switch(tenant, enabled, request.user, request.META.get("REMOTE_ADDR")):
            messages.success(request, f"Content logging is now {'on' if enabled else 'off'}.")
        return redirect("portal:content_logging")
    return page(request, "portal/content_logging.html", {
        "form": form,
        "retention_days": getattr(tenant, "content_retention_days", None),
        "max_retention_days": getattr(settings, "CONTENT_LOG_MAX_RETENTION_DAYS", 30),
        "changes": ContentLoggingChange.objects.filter(tenant=tenant).select_related(
            "changed_by")[:50],
        "access_log": _break_glass_entries(tenant),
    })


def _break_glass_entries(tenant: Tenant) -> list[object]:
    if not apps.is_installed("gateway.contentlog"):
        return []
    from gateway.contentlog.breakglass import audit_entries_for_tenant

    return list(audit_entries_for_tenant(tenant)[:50])
