"""Budgets as the hot path reads them: plain rules loaded with a key's principal, periods in UTC,
and the end user a request names.

The rules travel in ``tenants.auth.Principal`` (loaded with the key, cached like its quotas), so
admission never reads the database. Money limits are whole micro-units of their currency
(``MICRO`` per unit), so the Lua scripts add and compare integers exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any

from infra.redis_conn import tenant_key

MICRO = 1_000_000  # budget counters hold money in micro-units: 1 USD = 1,000,000
END_USER_MAX = 256  # characters of an end-user id (OpenAI's `user` / `safety_identifier`)


@dataclass(frozen=True)
class BudgetRule:
    """One enabled budget: ``ident`` is the tenant, project or key id, or the end user."""

    budget_id: int
    level: str  # "tenant", "project", "key", "end_user"
    ident: str
    metric: str  # "money" or "tokens"
    limit: int  # micro-units of ``currency``, or tokens
    currency: str
    period: str  # "day", "week", "month", "lifetime"

    @property
    def money(self) -> bool:
        return self.metric == "money"


def to_units(amount: Decimal, metric: str) -> int:
    """A configured limit in counter units (floored: a budget never allows more than it says)."""
    scale = MICRO if metric == "money" else 1
    return int((Decimal(amount) * scale).to_integral_value(rounding=ROUND_FLOOR))


def from_units(units: int, metric: str) -> Decimal:
    return Decimal(units) / MICRO if metric == "money" else Decimal(units)


def micro_ceil(value: Decimal) -> int:
    return int((value * MICRO).to_integral_value(rounding=ROUND_CEILING))


# -- periods ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """One period of a budget: its counter label, its start and its end (None: lifetime)."""

    label: str
    start: datetime | None
    end: datetime | None


def window(period: str, now: datetime) -> Window:
    """The UTC period containing ``now``: days from midnight, weeks from Monday, calendar months.

    The label is part of the counter's Redis key, so a period resets by moving to a new key, and
    a request keeps the label it was admitted under (charged to the period that admitted it).
    """
    day = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return Window(f"d{day:%Y%m%d}", day, day + timedelta(days=1))
    if period == "week":
        start = day - timedelta(days=day.weekday())
        return Window(f"w{start:%Y%m%d}", start, start + timedelta(days=7))
    if period == "month":
        start = day.replace(day=1)
        end = start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)
        return Window(f"m{start:%Y%m}", start, end)
    return Window("life", None, None)


def counter_key(tenant_id: object, rule: BudgetRule, label: str) -> str:
    """A budget's spend in one period, on the tenant's slot (admitted with its buckets)."""
    return tenant_key("budget", tenant_id, rule.level, rule.ident, rule.metric, rule.period,
                      label)


# -- loading ----------------------------------------------------------------------------------


def rule_of(budget: Any) -> BudgetRule:
    ident = {"tenant": budget.tenant_id, "project": budget.project_id,
             "key": budget.api_key_id, "end_user": budget.end_user}[budget.level]
    return BudgetRule(budget.pk, budget.level, str(ident), budget.metric,
                      to_units(budget.limit, budget.metric), budget.currency, budget.period)


@dataclass(frozen=True)
class KeyBudgets:
    """The rules a key's requests answer to: its chain, and the tenant's end-user rules."""

    chain: tuple[BudgetRule, ...] = ()  # tenant, project, key
    end_user_defaults: tuple[BudgetRule, ...] = ()
    end_user_overrides: Mapping[str, tuple[BudgetRule, ...]] | None = None

    def for_end_user(self, end_user: str) -> tuple[BudgetRule, ...]:
        """An end user's overrides replace the defaults of the same metric and period."""
        if not end_user:
            return ()
        own = (self.end_user_overrides or {}).get(end_user, ())
        mine = {(r.metric, r.period) for r in own}
        # A default binds each end user apart: its counter is keyed by the end user, not by
        # the default's blank name (which would make every end user share one budget).
        return (*own, *(replace(r, ident=end_user) for r in self.end_user_defaults
                        if (r.metric, r.period) not in mine))

    def rules(self, end_user: str = "") -> tuple[BudgetRule, ...]:
        return (*self.chain, *self.for_end_user(end_user))


def key_budgets(tenant_id: int, project_id: int | None, key_id: int,
                budgets: Iterable[Any]) -> KeyBudgets:
    """From the tenant's enabled ``Budget`` rows, the ones that bind this key."""
    chain: list[BudgetRule] = []
    defaults: list[BudgetRule] = []
    overrides: dict[str, list[BudgetRule]] = {}
    for budget in budgets:
        rule = rule_of(budget)
        if budget.level == "tenant" or (budget.level == "key" and budget.api_key_id == key_id) or (
                budget.level == "project" and project_id and budget.project_id == project_id):
            chain.append(rule)
        elif budget.level == "end_user" and not budget.end_user:
            defaults.append(rule)
        elif budget.level == "end_user":
            overrides.setdefault(budget.end_user, []).append(rule)
    return KeyBudgets(tuple(chain), tuple(defaults),
                      {k: tuple(v) for k, v in overrides.items()})


# -- the end user -----------------------------------------------------------------------------


def end_user_of(body: Mapping[str, Any], headers: Mapping[str, str], header: str = "") -> str:
    """Who the request is for, inside its tenant: the tenant's header when it chose one, else
    ``safety_identifier`` (OpenAI's newer name), else ``user``. '' when none is given."""
    if header:
        return str(headers.get(header.lower(), ""))[:END_USER_MAX]
    for name in ("safety_identifier", "user"):
        value = body.get(name)
        if isinstance(value, str) and value:
            return value[:END_USER_MAX]
    return ""
