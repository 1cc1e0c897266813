"""The numbers behind the usage and quota pages, read from the hourly rollups.

Everything here aggregates ``UsageRollup`` (one row per hour, key and model), so a page costs
the same with millions of raw records. The one exception is time-to-first-token percentiles:
rollups keep only TTFT sums, so p50/p95 come from the raw records of the last 24 hours, one
indexed range scan on (tenant, finished_at) computed inside PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from django.db import connection
from django.db.models import Aggregate, FloatField, Sum
from django.db.models.functions import TruncDay, TruncHour
from django.utils import timezone

from infra.redis_conn import get_redis
from metering.billing import reports
from metering.metrics import rejected_key
from metering.models import UsageRecord
from tenants.models import ApiKey, Tenant

RANGES = {"24h": timedelta(hours=24), "7d": timedelta(days=7), "30d": timedelta(days=30)}
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
        ):
            target.setdefault(name, [0.0] * len(buckets))[i] += float(value or 0)
        # The mean over requests that completed: the rollup keeps only a TTFT sum, and requests
        # that failed before their first token add nothing to it.
        completed = row["n"] - row["err"]
        ttft = result.ttft_mean.setdefault(name, [None] * len(buckets))
        ttft[i] = row["ttft"] / completed if completed > 0 else ttft[i]
    return result


def _series_names(by: str, tenant: Tenant):  # type: ignore[no-untyped-def]
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
    values = sorted(records.values_list("ttft_ms", flat=True)[:100_000])
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
