"""Money as people read it: one rounding rule, one way to write an amount.

Costs are exact ``Decimal`` products (``Price.cost``) and stay exact in the database and in
the reports' ``cost`` field, so reports reconcile with the records to the last digit. What a
person is shown or billed is an *amount*: the exact cost of one row rounded to the currency's
minor unit, half up (``round_money``). A total's amount is the sum of its rows' amounts, never
the rounded exact total, so the rows of a statement always add up to the total printed under
them (the cost of this rule: a total may differ from the rounded exact sum by up to half a
minor unit per row; docs/adr explains why an invoice prefers that).
"""

from __future__ import annotations

from collections.abc import Iterable
from decimal import ROUND_HALF_UP, Decimal

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


def total_amount(amounts: Iterable[Decimal], currency: str) -> Decimal:
    """A total is the sum of already-rounded amounts (so rows add up to it on paper)."""
    return sum((round_money(a, currency) for a in amounts), round_money(Decimal(0), currency))


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
