"""The numbers behind the usage and quota pages, read from the hourly rollups.

Everything here aggregates ``UsageRollup`` (one row per hour, key and model), so a page costs
the same with millions of raw records. The one exception is time-to-first-token percentiles:
rollups keep only TTFT sums, so p50/p95 come from the raw records of the last 24 hours, one
indexed range scan on (tenant, finished_at) computed inside PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import connection
from django.db.models import Aggregate, FloatField, Sum
from django.db.models.functions import TruncDay, TruncHour
from django.utils import timezone

from infra.redis_conn import get_redis
from metering.billing import reports
from metering.billing.pricing import PriceBook
from metering.metrics import rejected_key
from metering.models import UsageRecord
from tenants.models import ApiKey, Tenant

RANGES = {"24h": timedelta(hours=24), "7d": timedelta(days=7), "30d": timedelta(days=30),
          "90d": timedelta(days=90)}
PERCENTILE_WINDOW = timedelta(hours=24)


class Percentile(Aggregate):
    function = "percentile_cont"
    template = "%(function)s(%(p)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()

    def __init__(self, expression: str, p: float) -> None:
        super().__init__(expression, p=p)


@dataclass
class Series:
    buckets: list[datetime]
    input: dict[str, list[float]]
    output: dict[str, list[float]]
    ttft_mean: dict[str, list[float | None]]  # None: no request got a token that bucket
    errors: dict[str, list[float]]
    requests: dict[str, list[float]] = field(default_factory=dict)
    # Spend per currency, then per series: exact costs summed per bucket (rounded on display).
    spend: dict[str, dict[str, list[Decimal]]] = field(default_factory=dict)
    unpriced_tokens: int = 0  # tokens of models with no price in the range: flagged on the page


def _buckets(start: datetime, end: datetime, grain: str) -> list[datetime]:
    step = timedelta(days=1) if grain == "day" else timedelta(hours=1)
    first = start.replace(minute=0, second=0, microsecond=0)
    if grain == "day":
        first = first.replace(hour=0)
    out = []
    while first < end:
        out.append(first)
        first += step
    return out


def series(
    tenant: Tenant, start: datetime, end: datetime, *, grain: str = "hour", by: str = "model",
    key_ids: Sequence[int] | None = None,
) -> Series:
    trunc = TruncDay("hour") if grain == "day" else TruncHour("hour")
    group = "model_name" if by == "model" else "api_key_id"
    rows = (
        reports.rollups(start, end, tenant=tenant, api_key_ids=key_ids)
        .annotate(bucket=trunc).values("bucket", group)
        .annotate(inp=Sum("prompt_tokens"), out=Sum("completion_tokens"), n=Sum("requests"),
                  err=Sum("errors"), ttft=Sum("ttft_ms_sum"))
        .order_by("bucket")
    )
    buckets = _buckets(start, end, grain)
    index = {b: i for i, b in enumerate(buckets)}
    names = _series_names(by, tenant)
    result = Series(buckets, {}, {}, {}, {})
    for row in rows:
        i = index.get(row["bucket"])
        if i is None:
            continue
        name = names(row[group])
        for target, value in (
            (result.input, row["inp"]), (result.output, row["out"]), (result.errors, row["err"]),
            (result.requests, row["n"]),
        ):
            target.setdefault(name, [0.0] * len(buckets))[i] += float(value or 0)
        # The mean over requests that completed: the rollup keeps only a TTFT sum, and requests
        # that failed before their first token add nothing to it.
        completed = row["n"] - row["err"]
        ttft = result.ttft_mean.setdefault(name, [None] * len(buckets))
        ttft[i] = row["ttft"] / completed if completed > 0 else ttft[i]
    _add_spend(result, tenant, start, end, grain=grain, group=group, names=names, key_ids=key_ids)
    return result


def _add_spend(result: Series, tenant: Tenant, start: datetime, end: datetime, *, grain: str,
               group: str, names: SeriesNames, key_ids: Sequence[int] | None) -> None:
    """Cost each (hour, series, model) at the price of its hour, as reports do, then bucket."""
    qs = reports.rollups(start, end, tenant=tenant, api_key_ids=key_ids)
    book = PriceBook(qs.values_list("model_name", flat=True).distinct().order_by())
    rows = (qs.values("hour", group, "model_name").order_by()
            .annotate(p=Sum("prompt_tokens"), c=Sum("cached_tokens"), o=Sum("completion_tokens")))
    index = {b: i for i, b in enumerate(result.buckets)}
    for row in rows:
        hour = row["hour"]
        bucket = hour.replace(hour=0) if grain == "day" else hour
        i = index.get(bucket)
        if i is None:
            continue
        cost, currency = book.cost(row["model_name"], hour, row["p"], row["c"], row["o"])
        if not currency:
            result.unpriced_tokens += row["p"] + row["o"]
            continue
        per_series = result.spend.setdefault(currency, {})
        per_series.setdefault(names(row[group]), [Decimal(0)] * len(result.buckets))[i] += cost


@dataclass
class KeyUsage:
    requests: int = 0
    tokens: int = 0
    spend: dict[str, Decimal] = field(default_factory=dict)  # currency -> rounded amount
    unpriced: bool = False


def per_key(tenant: Tenant, start: datetime, end: datetime,
            key_ids: Sequence[int] | None = None) -> dict[int | None, KeyUsage]:
    """Requests, tokens and spend of each key over [start, end), from one grouped report."""
    report = reports.build_report(start, end, tenant=tenant, group_by=("key",),
                                  api_key_ids=key_ids)
    out: dict[int | None, KeyUsage] = {}
    for row in report.rows:
        usage = out.setdefault(row.key_id, KeyUsage())
        usage.requests += row.requests
        usage.tokens += row.input_tokens + row.output_tokens
        if row.priced and row.amount is not None:  # build_report sets a priced row's amount
            usage.spend[row.currency] = usage.spend.get(row.currency, Decimal(0)) + row.amount
        else:
            usage.unpriced = True
    return out


# A series' label from its key: a model name (str) or an API key id (int, None for no key),
# as ``by`` groups the rows.
SeriesNames = Callable[[Any], str]


def _series_names(by: str, tenant: Tenant) -> SeriesNames:
    if by == "model":
        return str
    keys = {k.id: f"{k.name} {k.masked}" for k in ApiKey.objects.filter(tenant=tenant)}
    return lambda kid: keys.get(kid, "(no key)" if kid is None else f"(deleted key #{kid})")


def ttft_percentiles(
    tenant: Tenant, now: datetime, key_ids: Sequence[int] | None = None
) -> dict[str, float | None]:
    records = UsageRecord.objects.filter(
        tenant=tenant, finished_at__gte=now - PERCENTILE_WINDOW, ttft_ms__isnull=False
    )
    if key_ids is not None:
        records = records.filter(api_key_id__in=list(key_ids))
    if connection.vendor == "postgresql":
        return records.aggregate(p50=Percentile("ttft_ms", 0.5), p95=Percentile("ttft_ms", 0.95))
    values = sorted(v for v in records.values_list("ttft_ms", flat=True)[:100_000]
                    if v is not None)
    if not values:
        return {"p50": None, "p95": None}
    return {q: float(values[min(int(p * len(values)), len(values) - 1)])
            for q, p in (("p50", 0.5), ("p95", 0.95))}


@dataclass
class MonthToDate:
    start: datetime
    input_tokens: int
    output_tokens: int
    requests: int
    cost: list[reports.ReportRow]
    input_capacity: int  # what the input rate quota would have allowed since the month began
    output_capacity: int


def month_to_date(tenant: Tenant, now: datetime, limits: object,
                  key_ids: Sequence[int] | None = None) -> MonthToDate:
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    report = reports.build_report(start, now + timedelta(hours=1), tenant=tenant, group_by=(),
                                  api_key_ids=key_ids)
    minutes = int((now - start).total_seconds() // 60) + 1
    return MonthToDate(
        start=start,
        input_tokens=sum(t.input_tokens for t in report.totals),
        output_tokens=sum(t.output_tokens for t in report.totals),
        requests=sum(t.requests for t in report.totals),
        cost=[t for t in report.totals if t.currency],
        input_capacity=limits.input_tpm * minutes,  # type: ignore[attr-defined]
        output_capacity=limits.output_tpm * minutes,  # type: ignore[attr-defined]
    )


def percent(part: float | Decimal, whole: float | Decimal) -> float:
    return round(100 * float(part) / float(whole), 1) if whole else 0.0


def now_range(name: str, now: datetime | None = None) -> tuple[datetime, datetime]:
    now = now or timezone.now()
    end = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    return end - RANGES.get(name, RANGES["24h"]), end


def rejections(tenant: Tenant) -> list[tuple[str, str, int]] | None:
    """(model, reason, count) of the tenant's 429s, from the gateway's shared counter
    (``metering.metrics``: one Redis hash, cumulative, no time dimension). None if unreadable."""
    try:

        fields = get_redis().hscan_iter(rejected_key(), match=f"{tenant.pk}|*", count=1000)
        rows = []
        for field, count in fields:
            _, model, reason = field.decode().split("|", 2)
            rows.append((model, reason, int(count)))
    except Exception:  # the counters are optional; the page renders without them
        return None
    return sorted(rows)
