"""Which price applies to a model at an hour: the row with the latest ``effective_from`` <= it."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from datetime import datetime
from decimal import Decimal

from metering.billing.models import Price

ZERO = Decimal(0)


class PriceBook:
    """Every price of the given models, loaded once, so a report costs rows without queries."""

    def __init__(self, model_names: Iterable[str] | None = None) -> None:
        rows = Price.objects.order_by("model_name", "effective_from")
        if model_names is not None:
            rows = rows.filter(model_name__in=set(model_names))
        self._by_model: dict[str, list[Price]] = {}
        for price in rows:
            self._by_model.setdefault(price.model_name, []).append(price)
        self._starts = {m: [p.effective_from for p in ps] for m, ps in self._by_model.items()}

    def at(self, model_name: str, when: datetime) -> Price | None:
        starts = self._starts.get(model_name)
        if not starts:
            return None
        index = bisect.bisect_right(starts, when) - 1
        return self._by_model[model_name][index] if index >= 0 else None

    def cost(
        self, model_name: str, when: datetime, prompt: int, cached: int, completion: int
    ) -> tuple[Decimal, str]:
        """(cost, currency); an unpriced model costs zero and has currency '' (reports flag it)."""
        price = self.at(model_name, when)
        if price is None:
            return ZERO, ""
        return price.cost(prompt, cached, completion), price.currency
