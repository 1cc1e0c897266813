"""Budgets' soft thresholds (50/80/100 %): owners and billing members are emailed once per
threshold and period, however many checkers run (metering.billing.budget_alerts)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.core import mail

from metering.billing import budget_alerts
from tenants.budgets import counter_key, rule_of, window
from tenants.models import Budget
from tests.worlds import build_world

pytestmark = pytest.mark.django_db
NOW = datetime(2026, 12, 15, 12, tzinfo=UTC)


@pytest.fixture
def world(redis_client):
    return build_world()


def _spend(redis_client, budget: Budget, units: int, when: datetime = NOW) -> None:
    rule = rule_of(budget)
    redis_client.set(counter_key(budget.tenant_id, rule, window(rule.period, when).label), units)


def test_each_threshold_notifies_owners_and_billing_once_per_period(world, redis_client):
    budget = Budget.objects.create(tenant=world.tenant, level="key", api_key=world.keys["member"],
                                   limit=Decimal("2"), period="month")
    _spend(redis_client, budget, 900_000)  # 0.90 of 2.00 USD: under 50 %
    assert budget_alerts.check_all(NOW) == []
    _spend(redis_client, budget, 1_000_000)
    [crossed] = budget_alerts.check_all(NOW)
    assert (crossed.pct, crossed.emailed) == (50, 2)
    assert sorted(mail.outbox[0].to) == ["billing@example.test", "owner@example.test"]
    assert "50% used" in mail.outbox[0].body and "member key" in mail.outbox[0].body
    assert budget_alerts.check_all(NOW) == []  # once
    _spend(redis_client, budget, 2_000_000)  # straight past 80 to 100: one email, at 100
    [crossed] = budget_alerts.check_all(NOW)
    assert crossed.pct == 100 and "insufficient_quota" in mail.outbox[-1].body
    assert len(mail.outbox) == 2
    january = NOW + timedelta(days=20)
    _spend(redis_client, budget, 1_700_000, january)  # a new period starts anew: 85 %
    assert [c.pct for c in budget_alerts.check_all(january)] == [80]


def test_two_checkers_racing_notify_once(world, redis_client):
    budget = Budget.objects.create(tenant=world.tenant, level="tenant", metric="tokens",
                                   limit=Decimal(1000), period="day")
    _spend(redis_client, budget, 600)
    stale = [Budget.objects.get(pk=budget.pk) for _ in range(2)]
    results = [budget_alerts.check(b, NOW) for b in stale]
    assert sum(r is not None for r in results) == 1 and len(mail.outbox) == 1
