"""Reports (streamed or exported by Celery), monthly statements, spend alerts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from django.contrib import messages
from django.http import (
    FileResponse,
    Http404,
    HttpResponse,
    JsonResponse,
)
from django.http.response import HttpResponseBase
from django.shortcuts import get_object_or_404, redirect
from django.utils import timezone
from django.views.decorators.http import require_POST

from gateway.portal.forms import AlertForm, ReportForm
from gateway.portal.tenancy import TenantRequest, tenant_view
from gateway.portal.views.base import page
from metering.billing import alerts, exports, reports
from metering.billing.downloads import report_response
from metering.billing.models import AlertEvent, ExportJob, SpendAlert
from tenants.models import Tenant


@tenant_view("reports")
def reports_page(request: TenantRequest) -> HttpResponseBase:
    tenant, now = request.tenant, timezone.now()
    initial = {"start": now.replace(day=1, hour=0, minute=0, second=0, microsecond=0),
               "end": reports.floor_hour(now) + timedelta(hours=1), "format": "csv"}
    form = ReportForm(request.POST or None, initial=initial)
    if request.method == "POST" and form.is_valid():
        return _download_or_queue(request, tenant, form.cleaned_data)
    jobs = ExportJob.objects.filter(tenant=tenant)[:20]
    return page(request, "portal/reports.html", {"form": form, "jobs": jobs,
                                                 "months": _recent_months(now)})


def _download_or_queue(request: TenantRequest, tenant: Tenant,
                       data: dict[str, Any]) -> HttpResponseBase:
    group_by = reports.parse_group_by(data["group_by"] or ["model"])
    if exports.is_large(data["start"], data["end"], tenant):
        job = exports.queue_export(tenant=tenant, user=request.user, start=data["start"],
                                   end=data["end"], group_by=",".join(group_by), fmt=data["format"])
        messages.info(request, "That range is large: it is being exported in the background.")
        return redirect("portal:export", pk=job.pk)
    report = reports.build_report(data["start"], data["end"], tenant=tenant, group_by=group_by)
    name = f"usage-{tenant.slug}-{report.start:%Y%m%d%H}-{report.end:%Y%m%d%H}"
    return report_response(report, data["format"], name)


def _recent_months(now: datetime, count: int = 6) -> list[str]:
    months, year, month = [], now.year, now.month
    for _ in range(count):
        months.append(f"{year:04d}-{month:02d}")
        year, month = (year - 1, 12) if month == 1 else (year, month - 1)
    return months


def _job(request: TenantRequest, pk: int) -> ExportJob:
    return get_object_or_404(ExportJob, pk=pk, tenant=request.tenant)


@tenant_view("reports")
def export_page(request: TenantRequest, pk: int) -> HttpResponse:
    return page(request, "portal/export.html", {"job": _job(request, pk)})


@tenant_view("reports")
def export_status(request: TenantRequest, pk: int) -> HttpResponse:
    job = _job(request, pk)
    return JsonResponse({"status": job.status, "progress": job.progress,
                         "rows_done": job.rows_done, "rows_total": job.rows_total,
                         "error": job.error})


@tenant_view("reports")
def export_download(request: TenantRequest, pk: int) -> HttpResponseBase:
    job = _job(request, pk)
    path = Path(job.file_path) if job.file_path else None
    if job.status != ExportJob.Status.DONE or path is None or not path.is_file():
        raise Http404("This export has no file yet.")
    return FileResponse(path.open("rb"), as_attachment=True, filename=job.filename)


@tenant_view("reports")
def statement_page(request: TenantRequest) -> HttpResponseBase:
    tenant, now = request.tenant, timezone.now()
    asked = request.GET.get("month", "")
    try:
        year, month = (int(p) for p in asked.split("-"))
        start, end = reports.month_range(year, month, UTC)
    except ValueError:
        if asked:  # never a silent swap for the current month
            return page(request, "portal/statement.html", {
                "invalid_month": asked, "months": _recent_months(now)}, status=400)
        start, end = reports.month_range(now.year, now.month, UTC)
    report = reports.build_report(start, end, tenant=tenant, group_by=("model", "key"))
    fmt = request.GET.get("format")
    if fmt in ("csv", "xlsx"):
        title = f"Statement for {tenant.name}, {start:%Y-%m}, issued {now:%Y-%m-%d %H:%M} UTC"
        return report_response(report, fmt, f"statement-{tenant.slug}-{start:%Y-%m}", title)
    return page(request, "portal/statement.html",
                {"report": report, "month": f"{start:%Y-%m}", "issued": now})


@tenant_view("alerts")
def alerts_page(request: TenantRequest) -> HttpResponse:
    tenant = request.tenant
    form = AlertForm(request.POST or None, tenant=tenant)
    if request.method == "POST" and form.is_valid():
        try:
            alert = alerts.create_alert(tenant, created_by=request.user, **{
                name: form.cleaned_data[name] for name in form.Meta.fields})
        except alerts.TooManyAlerts as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(request, "Spend alert added.")
            if getattr(alert, "secret_is_new", False):
                messages.warning(request, "Webhook signing secret, shown only now: "
                                 f"{alert.webhook_secret} (verify the X-Gateway-Signature "
                                 "header of each delivery with it).")
            return redirect("portal:alerts")
    return page(request, "portal/alerts.html", {
        "form": form,
        "alerts": SpendAlert.objects.filter(tenant=tenant).select_related("api_key"),
        "events": AlertEvent.objects.filter(alert__tenant=tenant).select_related("alert")[:50],
    })


@tenant_view("alerts")
@require_POST
def alert_rotate_secret(request: TenantRequest, pk: int) -> HttpResponse:
    alert = get_object_or_404(SpendAlert, pk=pk, tenant=request.tenant)
    if alert.webhook_url:
        messages.warning(request, "New webhook signing secret, shown only now: "
                         f"{alert.rotate_secret()} (the old one stops signing at once).")
    return redirect("portal:alerts")


@tenant_view("alerts")
@require_POST
def alert_delete(request: TenantRequest, pk: int) -> HttpResponse:
    get_object_or_404(SpendAlert, pk=pk, tenant=request.tenant).delete()
    messages.success(request, "Spend alert removed.")
    return redirect("portal:alerts")
