"""Budgets' soft thresholds: at 50, 80 and 100 % of a budget's period, its tenant's owners and
billing members are emailed once per threshold and period.

Spend is read from the budget's live counter (``tenants.budgets.counter_key``: what admission
reserved and settlement trued up, so it includes requests still running at their reservation).
Once: a threshold is claimed with one conditional UPDATE (``notified_period``/``notified_pct``
below it -> it), so checkers racing in several processes email once, like spend alerts
(``metering.billing.alerts``), whose recipients and mail path this shares.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.core.mail import send_mail
from django.db.models import Q
from django.utils import timezone

from infra.redis_conn import get_redis
from metering.billing.alerts import notify_emails
from tenants.budgets import counter_key, from_units, rule_of, window
from tenants.models import Budget

log = logging.getLogger(__name__)
THRESHOLDS = (50, 80, 100)  # percent of the budget


@dataclass(frozen=True)
class Crossed:
    budget_id: int
    period: str
    pct: int
    used: int  # counter units (micro-units of money, or tokens)
    emailed: int


def used_units(budget: Budget, now: datetime) -> tuple[str, int]:
    """(period label, spend so far in counter units) of a budget's current period."""
    rule = rule_of(budget)
    label = window(rule.period, now).label
    return label, int(get_redis().get(counter_key(budget.tenant_id, rule, label)) or 0)


def reached(used: int, limit: int) -> int:
    """The highest threshold ``used`` has reached (0 = none)."""
    if limit <= 0:
        return THRESHOLDS[-1] if used > 0 else 0
    return max((t for t in THRESHOLDS if used * 100 >= t * limit), default=0)


def check_all(now: datetime | None = None) -> list[Crossed]:
    now = now or timezone.now()
    out = []
    for budget in Budget.objects.filter(enabled=True).select_related("tenant", "project",
                                                                      "api_key"):
        if (crossed := check(budget, now)) is not None:
            out.append(crossed)
    return out


def check(budget: Budget, now: datetime) -> Crossed | None:
    label, used = used_units(budget, now)
    pct = reached(used, rule_of(budget).limit)
    if not pct or (budget.notified_period == label and budget.notified_pct >= pct):
        return None
    claimed = Budget.objects.filter(pk=budget.pk).filter(
        ~Q(notified_period=label) | Q(notified_pct__lt=pct)
    ).update(notified_period=label, notified_pct=pct)
    if not claimed:
        return None  # another checker notified this threshold
    return Crossed(budget.pk, label, pct, used, _email(budget, label, pct, used))


def describe(budget: Budget, pct: int, used: int) -> str:
    spent = from_units(used, budget.metric)
    shown = f"{spent:,.2f} {budget.currency}" if budget.metric == "money" else f"{spent:,} tokens"
    then = ("New requests that would cross it are refused (429 insufficient_quota) until the "
            "period resets or an owner raises it." if pct >= 100 else "")
    return (f"{budget.tenant.name}: the {budget.scope_text} budget of {budget.limit_text} per "
            f"{budget.period} (UTC) is {pct}% used ({shown}). {then}").strip()


def _email(budget: Budget, label: str, pct: int, used: int) -> int:
    emails = notify_emails(budget.tenant)
    if not emails:
        return 0
    subject = f"[gateway] Budget {pct}% used: {budget.tenant.name}, {budget.scope_text} ({label})"
    sent = send_mail(subject, describe(budget, pct, used), settings.DEFAULT_FROM_EMAIL, emails,
                     fail_silently=True)
    return len(emails) if sent else 0
