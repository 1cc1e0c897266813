"""Chart descriptions for the usage dashboard, drawn in the browser by Chart.js (vendored in
``static/portal/vendor``, served by the gateway itself: no CDN).

The server decides everything a reader could get wrong (which series, bucket labels, units,
integer or money axes, currency digits) and hands the browser a plain JSON description
(``json_script``); ``static/portal/charts.js`` only draws it: bars stacked by series, values
with thousands separators on hover, axis ticks at nice steps (integers for counts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from metering.billing.money import minor_unit, round_money

PALETTE = ("#2563eb", "#f59e0b", "#16a34a", "#dc2626", "#9333ea", "#0891b2", "#db2777",
           "#65a30d", "#4b5563", "#ea580c")
MAX_SERIES = 8  # more would be unreadable: the rest are summed into "other"


def _top(series: Mapping[str, Sequence[Any]], fold: bool = True) -> dict[str, list[Any]]:
    """The largest series by total, the rest folded into one "other" series (``fold``: sums;
    means cannot be added, so a line of means keeps the largest series and drops the rest)."""
    ranked = sorted(series.items(), key=lambda kv: -sum(v or 0 for v in kv[1]))
    if len(ranked) <= MAX_SERIES:
        return {name: list(values) for name, values in ranked}
    if not fold:
        return {name: list(values) for name, values in ranked[:MAX_SERIES]}
    kept = dict(ranked[: MAX_SERIES - 1])
    other: list[Any] = [0] * len(ranked[0][1])
    for _, values in ranked[MAX_SERIES - 1:]:
        other = [a + (b or 0) for a, b in zip(other, values, strict=True)]
    return {**{k: list(v) for k, v in kept.items()}, "other": other}


def chart(
    chart_id: str, title: str, buckets: Sequence[datetime],
    series: Mapping[str, Sequence[float | Decimal | None]], *, kind: str = "bar",
    unit: str = "", currency: str = "", integer: bool = True,
) -> dict[str, Any]:
    """One chart: ``kind`` "bar" (stacked) or "line"; money when ``currency`` is set."""
    places = minor_unit(currency) if currency else (0 if integer else 1)
    datasets = []
    for index, (name, values) in enumerate(_top(series, fold=kind != "line").items()):
        color = PALETTE[index % len(PALETTE)]
        data = [None if v is None else _number(v, currency, integer) for v in values]
        total = sum((v for v in values if v is not None), Decimal(0) if currency else 0)
        datasets.append({"label": name, "data": data, "backgroundColor": color,
                         "borderColor": color, "total": _number(total, currency, integer)})
    return {
        "id": chart_id, "data_id": f"{chart_id}-data", "title": title, "kind": kind,
        "unit": unit, "currency": currency,
        "integer": integer and not currency, "places": places,
        "labels": [b.isoformat() for b in buckets], "datasets": datasets,
    }


def _number(value: float | Decimal, currency: str, integer: bool) -> float | int:
    if currency:
        return float(round_money(Decimal(value), currency))
    return round(float(value)) if integer else round(float(value), 1)
