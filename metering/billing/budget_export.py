"""Budget against actual, per level, as a CSV for finance: every budget of a tenant with this
period's spend (the live counter), its percent, the projection and when it resets. Cells go
through ``spreadsheet.safe_row`` like every other export (an end user's id is the caller's
text)."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from datetime import datetime
from decimal import Decimal

from metering.billing.budget_status import status_of
from metering.billing.spreadsheet import safe_row
from tenants.models import Budget, Tenant

COLUMNS = ["level", "scope", "metric", "period", "limit", "actual", "percent",
           "projected", "currency", "resets_at"]


def rows(tenant: Tenant, now: datetime) -> Iterator[list[object]]:
    budgets = Budget.objects.filter(tenant=tenant).select_related("project", "api_key")
    for budget in budgets.order_by("level", "id"):
        status = status_of(budget, now)
        money = budget.metric == Budget.Metric.MONEY
        yield [budget.level, budget.scope_text, budget.metric, budget.period,
               f"{budget.limit.normalize():f}", f"{status.spent.normalize():f}", status.percent,
               "" if status.projected is None
               else f"{status.projected.quantize(Decimal('0.01') if money else Decimal(1)):f}",
               budget.currency if money else "",
               status.resets_at.isoformat() if status.resets_at else ""]


def csv_text(tenant: Tenant, now: datetime) -> str:
    out = io.StringIO()
    out.write("\ufeff")  # Excel reads UTF-8 only with the byte order mark (as reports.py)
    writer = csv.writer(out)
    writer.writerow(COLUMNS)
    for row in rows(tenant, now):
        writer.writerow(safe_row(row))
    return out.getvalue()
