"""Money as people read it: one rounding rule, one way to write an amount.

Costs are exact ``Decimal`` products (``Price.cost``) and stay exact in the database and in
the reports' ``cost`` field, so reports reconcile with the records to the last digit. What a
person is shown or billed is an *amount*: the exact cost of one row rounded to the currency's
minor unit, half up (``round_money``), and only a *total* is rounded that way: a total's
amount is the rounded exact sum, so every grouping of the same usage (by key, tenant, model,
day, or none) shows the same total. Rows are then given amounts by largest remainder
(``allocate``), so the printed rows still add up to the printed total (ADR 0013, amended).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from decimal import ROUND_FLOOR, ROUND_HALF_UP, Decimal

# ISO 4217 minor units where they are not 2 (the common case).
MINOR_UNITS: dict[str, int] = {
    "BHD": 3, "BIF": 0, "CLP": 0, "DJF": 0, "GNF": 0, "IQD": 3, "ISK": 0, "JOD": 3, "JPY": 0,
    "KMF": 0, "KRW": 0, "KWD": 3, "LYD": 3, "OMR": 3, "PYG": 0, "RWF": 0, "TND": 3, "UGX": 0,
    "UYI": 0, "VND": 0, "VUV": 0, "XAF": 0, "XOF": 0, "XPF": 0,
}
UNPRICED = "unpriced"


def minor_unit(currency: str) -> int:
    """Digits after the decimal point for ``currency`` (2 unless ISO 4217 says otherwise)."""
    return MINOR_UNITS.get(currency.upper(), 2)


def quantum(currency: str) -> Decimal:
    return Decimal(1).scaleb(-minor_unit(currency))


def round_money(amount: Decimal, currency: str) -> Decimal:
    """The one rounding rule: to the currency's minor unit, half up (0.005 USD -> 0.01)."""
    return Decimal(amount).quantize(quantum(currency), rounding=ROUND_HALF_UP)


def total_amount(costs: Iterable[Decimal], currency: str) -> Decimal:
    """A total is its exact costs summed, then rounded once: the same whatever the grouping."""
    return round_money(sum(costs, Decimal(0)), currency)


def allocate(costs: Sequence[Decimal], currency: str) -> list[Decimal]:
    """Rounded amounts for ``costs`` that add up to ``total_amount(costs)`` exactly.

    Largest remainder (Hamilton's method): each row gets its cost floored to the minor unit,
    and the minor units the total still needs go one each to the rows with the largest
    remainders (ties to the earlier row, so the result is deterministic). Each row's amount is
    within one minor unit of its exact cost.
    """
    q = quantum(currency)
    floors = [Decimal(c).quantize(q, rounding=ROUND_FLOOR) for c in costs]
    units = int((total_amount(costs, currency) - sum(floors, Decimal(0))) / q)
    by_remainder = sorted(range(len(costs)), key=lambda i: (-(costs[i] - floors[i]), i))
    for i in by_remainder[:units]:
        floors[i] += q
    return floors


def format_amount(amount: Decimal, currency: str) -> str:
    """``1234.5`` USD -> ``1,234.50``: thousands separators, exactly the minor unit's digits."""
    places = minor_unit(currency)
    return f"{round_money(amount, currency):,.{places}f}"


def format_money(amount: Decimal | None, currency: str) -> str:
    """``1,234.50 USD``; usage with no price says so instead of pretending it was free."""
    if not currency or amount is None:
        return UNPRICED
    return f"{format_amount(amount, currency)} {currency}"


def format_rate(rate: Decimal, currency: str) -> str:
    """A price per million tokens as money: ``0.500000`` USD -> ``0.50 USD``. A rate is never
    rounded (0.0375 stays 0.0375): at least the currency's digits, more only where it has them."""
    places = minor_unit(currency)
    exact = Decimal(rate).normalize()
    digits = max(places, -int(exact.as_tuple().exponent))
    return f"{Decimal(rate):,.{digits}f} {currency}"
