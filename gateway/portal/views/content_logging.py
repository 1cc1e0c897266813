"""The tenant's content-storing opt-ins: what each stores, the switches (content logging and the
response cache), and who switched them when."""

from __future__ import annotations

from django.apps import apps
from django.conf import settings
from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import redirect

from gateway.portal.forms import ContentLoggingForm
from gateway.portal.tenancy import TenantRequest, tenant_view
from gateway.portal.views.base import page
from tenants.content_logging import Setting, switch
from tenants.models import ContentLoggingChange, Tenant


@tenant_view("content_logging")
def content_logging_page(request: TenantRequest) -> HttpResponse:
    tenant = request.tenant
    posted = ContentLoggingForm(request.POST or None)
    if request.method == "POST" and posted.is_valid():
        setting = Setting(posted.cleaned_data["setting"] or Setting.CONTENT_LOGGING)
        enabled = posted.cleaned_data["enabled"]
        if switch(tenant, enabled, request.user, request.META.get("REMOTE_ADDR"), setting):
            state = "on" if enabled else "off"
            messages.success(request, f"{setting.label.capitalize()} is now {state}.")
        return redirect("portal:content_logging")
    failed = posted.cleaned_data.get("setting") if posted.is_bound else None
    return page(request, "portal/content_logging.html", {
        # Each switch gets its own form; a refused post shows its errors on the one it came from.
        "form": _form(posted, failed, Setting.CONTENT_LOGGING, tenant.content_logging),
        "cache_form": _form(posted, failed, Setting.RESPONSE_CACHE, tenant.response_cache),
        "retention_days": getattr(tenant, "content_retention_days", None),
        "max_retention_days": getattr(settings, "CONTENT_LOG_MAX_RETENTION_DAYS", 30),
        "cache_ttl_seconds": round(settings.RESPONSE_CACHE_TTL_SECONDS),
        "cache_max_entries": settings.RESPONSE_CACHE_MAX_ENTRIES,
        "changes": ContentLoggingChange.objects.filter(tenant=tenant).select_related(
            "changed_by")[:50],
        "access_log": _break_glass_entries(tenant),
    })


def _form(posted: ContentLoggingForm, failed: str | None, setting: Setting,
          enabled: bool) -> ContentLoggingForm:
    if posted.is_bound and (failed or Setting.CONTENT_LOGGING) == setting:
        return posted
    return ContentLoggingForm(initial={"setting": setting, "enabled": enabled})


def _break_glass_entries(tenant: Tenant) -> list[object]:
    if not apps.is_installed("gateway.contentlog"):
        return []
    from gateway.contentlog.breakglass import audit_entries_for_tenant

    return list(audit_entries_for_tenant(tenant)[:50])
