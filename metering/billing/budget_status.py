"""Where a budget stands now: spent, percent, when its period resets and the projected spend
at the end of the period (linear in time so far), for the portal, the admin and the API."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from metering.billing.budget_alerts import used_units
from tenants.budgets import from_units, window
from tenants.models import Budget


@dataclass(frozen=True)
class BudgetStatus:
    budget: Budget
    spent: Decimal  # money in the budget's currency, or tokens
    percent: float
    resets_at: datetime | None
    projected: Decimal | None  # at the period's end, if spending goes on at this rate

    @property
    def over(self) -> bool:
        return self.spent >= self.budget.limit


def status_of(budget: Budget, now: datetime) -> BudgetStatus:
    _, units = used_units(budget, now)
    spent = from_units(units, budget.metric)
    span = window(budget.period, now)
    projected = None
    if span.start is not None and span.end is not None:
        elapsed = (now - span.start).total_seconds()
        whole = (span.end - span.start).total_seconds()
        projected = spent * Decimal(whole / max(elapsed, 60.0)) if spent else Decimal(0)
    limit = budget.limit
    percent = float(spent / limit * 100) if limit else (100.0 if spent else 0.0)
    return BudgetStatus(budget, spent, round(percent, 1), span.end, projected)
