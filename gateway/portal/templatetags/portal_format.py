"""How numbers, money and times read on every page: ``{% load portal_format %}``.

- ``{{ n|num }}``: 1234567 -> "1,234,567" (thousands separators, no decimals for counts);
- ``{{ row|money }}``: a report row (``amount`` and ``currency``) -> "1,234.50 USD", or a flag
  for unpriced usage; ``{{ amount|money:"EUR" }}`` for a bare amount;
- ``{{ when|when }}``: a ``<time>`` element in UTC that ``static/portal/localtime.js`` rewrites
  into the reader's own time zone (without JavaScript the UTC text stays, labelled).
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django import template
from django.utils.html import format_html
from django.utils.safestring import SafeString

from metering.billing.money import format_money, format_rate

register = template.Library()
DASH = "\u2013"  # an en dash: "no value"


@register.filter
def num(value: Any, places: int | None = None) -> str:
    """Thousands separators; whole numbers without decimals, others to ``places`` (default:
    up to 2, trailing zeros dropped)."""
    if value is None or value == "":
        return DASH
    try:
        number = Decimal(str(value))
    except ArithmeticError:
        return str(value)
    if places is None:
        if number == number.to_integral_value():
            return f"{number:,.0f}"
        text = f"{number:,.2f}".rstrip("0")
        return text.rstrip(".")
    return f"{number:,.{int(places)}f}"


@register.filter
def money(value: Any, currency: str | None = None) -> SafeString | str:
    if currency is None:  # a report row, a total, or anything with amount and currency
        amount, currency = getattr(value, "amount", None), getattr(value, "currency", "")
    else:
        amount = value
    if not currency or amount is None:
        return format_html('<span class="unpriced" title="{}">unpriced</span>',
                           "No price was set for this model at that time")
    return format_money(Decimal(amount), currency)


@register.filter
def when(value: datetime | None, style: str = "datetime") -> SafeString | str:
    """``style``: "datetime" (to the minute) or "date"."""
    if value is None:
        return DASH
    utc = value.astimezone(UTC)
    text = f"{utc:%Y-%m-%d}" if style == "date" else f"{utc:%Y-%m-%d %H:%M} UTC"
    return format_html('<time datetime="{}" data-style="{}">{}</time>',
                       utc.isoformat().replace("+00:00", "Z"), style, text)


@register.filter
def rate(price: Any, field: str) -> str:
    """``{{ price|rate:"input_per_mtok" }}`` -> "0.50 USD" (per million tokens)."""
    return format_rate(getattr(price, field), price.currency)


@register.filter
def unit_for(unit: str, count: Any) -> str:
    """A plural unit for ``count``: "requests" for 2 or 0, "request" for exactly 1."""
    return unit[:-1] if unit.endswith("s") and count == 1 else unit
