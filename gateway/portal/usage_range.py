"""The usage page's time range: a preset (24 h, 7, 30, 90 days) or custom dates, and the
period just before it of the same length, for comparison."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

from django.http import QueryDict

from gateway.portal import usage

MAX_CUSTOM = timedelta(days=366)  # a year of daily bars; rollups keep that and more


@dataclass(frozen=True)
class UsageRange:
    start: datetime
    end: datetime
    preset: str  # "" for custom dates
    error: str = ""  # said once, on the page; the default range is shown instead

    @property
    def previous(self) -> tuple[datetime, datetime]:
        return self.start - (self.end - self.start), self.start

    @property
    def first_day(self) -> date:
        return self.start.date()

    @property
    def last_day(self) -> date:
        return (self.end - timedelta(microseconds=1)).date()


def _day(text: str) -> date | None:
    try:
        return date.fromisoformat(text)
    except ValueError:
        return None


def parse(params: QueryDict, now: datetime) -> UsageRange:
    """``from``/``to`` (YYYY-MM-DD, UTC days, both included) win over ``range``."""
    preset = params.get("range", "24h")
    preset = preset if preset in usage.RANGES else "24h"
    raw_from, raw_to = params.get("from", ""), params.get("to", "")
    if not raw_from and not raw_to:
        return UsageRange(*usage.now_range(preset, now), preset)
    first, last = _day(raw_from), _day(raw_to) if raw_to else now.date()
    error = ""
    if first is None or last is None:
        error = "Dates are written YYYY-MM-DD."
    elif last < first:
        error = "The last day comes before the first."
    elif first > now.date():
        error = "The range starts in the future: there is no usage there yet."
    if error or first is None or last is None:
        return UsageRange(*usage.now_range(preset, now), preset, error=error)
    start = datetime.combine(first, time.min, tzinfo=UTC)
    end = datetime.combine(last + timedelta(days=1), time.min, tzinfo=UTC)
    if end - start > MAX_CUSTOM:
        return UsageRange(*usage.now_range(preset, now), preset,
                          error="A custom range is at most 366 days.")
    return UsageRange(start, end, "")


def change(current: int | Decimal, previous: int | Decimal) -> int | None:
    """Percent change from the previous period; None when there was nothing to compare."""
    if not previous:
        return None
    return round((current - previous) * 100 / previous)
