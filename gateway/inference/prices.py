"""The price a request is reserved and settled at: the model's price in effect at admission.

Read from ``metering.billing.Price`` at most once per ``PRICE_CACHE_S`` per model and process
(only for a key with a money budget), so the hot path does no query per request. A price row
takes effect on the hour and is usually created ahead, so the cached rows already hold the
next price when its hour starts; a row created less than ``PRICE_CACHE_S`` before it starts
applies up to that late to reservations (the bill itself is costed from the rollups).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from channels.db import database_sync_to_async

from metering.billing.pricing import PriceBook
from serving.budgets import UnitPrices

PRICE_CACHE_S = 30.0
_books: dict[str, tuple[float, PriceBook]] = {}


def _load(model: str) -> PriceBook:
    return PriceBook([model])


async def unit_prices(model: str, now: float | None = None) -> UnitPrices | None:
    """The model's price now, in pico-units per token; None when it has no price."""
    clock = time.monotonic()
    cached = _books.get(model)
    if cached is None or clock - cached[0] > PRICE_CACHE_S:
        cached = (clock, await database_sync_to_async(_load)(model))
        _books[model] = cached
    when = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    price = cached[1].at(model, when)
    if price is None:
        return None
    return UnitPrices.per_mtok(price.currency, price.input_per_mtok,
                               price.cached_input_per_mtok, price.output_per_mtok)


def forget() -> None:
    """Drop the cache (tests that change prices)."""
    _books.clear()
