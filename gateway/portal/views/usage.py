"""Usage charts and the quotas page; numbers from ``gateway.portal.usage`` (hourly rollups)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from decimal import Decimal

from django.db.models import Sum
from django.db.models.functions import TruncHour
from django.http import HttpResponse
from django.http.response import HttpResponseBase
from django.utils import timezone

from catalog.visibility import models_for
from gateway.portal import usage, usage_range
from gateway.portal.charts import chart
from gateway.portal.tenancy import TenantRequest, tenant_view
from gateway.portal.views.base import page
from gateway.portal.views.keys import visible_keys
from infra.redis_conn import get_redis, tenant_key
from metering.billing import reports
from metering.billing.downloads import report_response
from metering.billing.models import SpendAlert
from tenants import roles
from tenants.limits import effective_limits


def own_key_ids(request: TenantRequest) -> list[int] | None:
    """None = the whole tenant; a member sees only the keys they made."""
    if roles.can(request.role, "all_usage"):
        return None
    return list(visible_keys(request).values_list("id", flat=True))


def _choice(request: TenantRequest, name: str, allowed: tuple[str, ...]) -> str:
    value = request.GET.get(name, allowed[0])
    return value if value in allowed else allowed[0]


@tenant_view("usage")
def usage_page(request: TenantRequest) -> HttpResponseBase:
    tenant, now = request.tenant, timezone.now()
    chosen = usage_range.parse(request.GET, now)
    span, start, end = chosen.preset, chosen.start, chosen.end
    # Hourly bars over a month would be 720 slivers: days are the default beyond one day.
    grain = _choice(request, "grain", ("hour", "day") if span == "24h" else ("day", "hour"))
    by = _choice(request, "by", ("model", "key"))
    key_ids = own_key_ids(request)
    if request.GET.get("format") == "csv":  # the range as shown, of the keys the reader sees
        return _export(request, chosen, key_ids)
    data = usage.series(tenant, start, end, grain=grain, by=by, key_ids=key_ids)
    totals = _range_totals(data)
    before = _range_totals(usage.series(tenant, *chosen.previous, grain="day", by="model",
                                        key_ids=key_ids))
    mtd = usage.month_to_date(tenant, now, effective_limits(tenant), key_ids)
    alerts = SpendAlert.objects.filter(tenant=tenant, period=SpendAlert.Period.MONTH, enabled=True)
    return page(request, "portal/usage.html", {
        "span": span, "grain": grain, "by": by, "ranges": list(usage.RANGES),
        "chosen": chosen, "previous": before,
        "changes": {k: usage_range.change(totals[k], before[k])  # type: ignore[arg-type]
                    for k in ("requests", "input", "output")},
        "charts": _charts(data, grain),
        "totals": totals,
        "unpriced_tokens": data.unpriced_tokens,
        "ttft": usage.ttft_percentiles(tenant, now, key_ids),
        "mtd": mtd,
        "mtd_input_pct": usage.percent(mtd.input_tokens, mtd.input_capacity),
        "mtd_output_pct": usage.percent(mtd.output_tokens, mtd.output_capacity),
        "monthly_alerts": _alert_progress(alerts, mtd),
        "scoped_to_own_keys": key_ids is not None,
        # Counted per tenant, not per key: only roles that see the whole tenant get them.
        "rejections": usage.rejections(tenant) if key_ids is None else None,
    })


def _charts(data: usage.Series, grain: str) -> list[dict[str, object]]:
    per = f"per {grain}"
    charts = [
        chart("chart-requests", f"Requests {per}", data.buckets, data.requests, unit="requests"),
        chart("chart-input", f"Input tokens {per}", data.buckets, data.input, unit="tokens"),
        chart("chart-output", f"Output tokens {per}", data.buckets, data.output, unit="tokens"),
    ]
    for currency, series in sorted(data.spend.items()):
        charts.append(chart(f"chart-spend-{currency.lower()}", f"Spend {per} ({currency})",
                            data.buckets, series, currency=currency))
    charts += [
        chart("chart-ttft", f"Mean time to first token {per}", data.buckets, data.ttft_mean,
              kind="line", unit="ms"),
        chart("chart-errors", f"Requests that did not complete {per}", data.buckets,
              data.errors, unit="requests"),
    ]
    return charts


def _export(request: TenantRequest, chosen: usage_range.UsageRange,
            key_ids: list[int] | None) -> HttpResponseBase:
    report = reports.build_report(chosen.start, chosen.end, tenant=request.tenant,
                                  group_by=("key", "model"), api_key_ids=key_ids)
    name = f"usage-{request.tenant.slug}-{chosen.first_day:%Y%m%d}-{chosen.last_day:%Y%m%d}"
    return report_response(report, "csv", name)


def _range_totals(data: usage.Series) -> dict[str, object]:
    def total(series: dict[str, list[float]]) -> int:
        return int(sum(sum(v) for v in series.values()))

    spend = {c: sum((sum(v, Decimal(0)) for v in s.values()), Decimal(0))
             for c, s in sorted(data.spend.items())}
    return {"requests": total(data.requests), "input": total(data.input),
            "output": total(data.output), "spend": spend}


def _alert_progress(alerts: Iterable[SpendAlert],
                    mtd: usage.MonthToDate) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for alert in alerts:
        if alert.api_key_id:
            continue  # the month-to-date figures are tenant-wide
        used = (mtd.input_tokens + mtd.output_tokens if alert.metric == SpendAlert.Metric.TOKENS
                else sum((c.amount or 0 for c in mtd.cost if c.currency == alert.currency),
                         Decimal(0)))
        rows.append({"alert": alert, "used": used, "pct": usage.percent(used, alert.threshold)})
    return rows


def _gauge(name: str, tenant_id: object) -> int | None:
    try:
        value = get_redis().get(tenant_key(name, tenant_id, "tenant"))
    except Exception:  # the page still renders without the live numbers
        return None
    return int(value or 0)


@tenant_view("quotas")
def quotas_page(request: TenantRequest) -> HttpResponse:
    tenant, now = request.tenant, timezone.now()
    peak = (
        reports.rollups(now - timedelta(hours=24), now + timedelta(hours=1), tenant=tenant)
        .annotate(h=TruncHour("hour")).values("h")
        .annotate(inp=Sum("prompt_tokens"), out=Sum("completion_tokens")).order_by()
    )
    peak_in = max((r["inp"] for r in peak), default=0) / 60
    peak_out = max((r["out"] for r in peak), default=0) / 60
    default = effective_limits(tenant)
    per_model = [(m, effective_limits(tenant, m)) for m in models_for(tenant)]
    concurrent = _gauge("conc", tenant.id)
    streams = _gauge("streams", tenant.id)
    return page(request, "portal/quotas.html", {
        "default": default, "per_model": per_model,
        "per_model_rows": [(None, default), *per_model],
        "concurrent": concurrent, "streams": streams,
        "concurrent_pct": usage.percent(concurrent or 0, default.concurrent_requests),
        "streams_pct": usage.percent(streams or 0, default.open_streams),
        "peak_in": round(peak_in), "peak_out": round(peak_out),
        "peak_in_pct": usage.percent(peak_in, default.input_tpm),
        "peak_out_pct": usage.percent(peak_out, default.output_tpm),
    })
