"""Query filters shared by the usage, rollup and report endpoints: time range, model, key."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta
from typing import TypeVar

from django.db.models import Model, QuerySet
from django.utils.dateparse import parse_date, parse_datetime
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request

_M = TypeVar("_M", bound=Model)

TIME_PARAMS = [
    OpenApiParameter("start", OpenApiTypes.DATETIME, description="From (inclusive), ISO 8601."),
    OpenApiParameter("end", OpenApiTypes.DATETIME, description="To (exclusive), ISO 8601."),
]
USAGE_PARAMS = [
    *TIME_PARAMS,
    OpenApiParameter("model", str, description="Only this model name."),
    OpenApiParameter("key", int, description="Only this API key id."),
]


def parse_time(name: str, text: str) -> datetime:
    """An ISO 8601 date or date-time, in UTC (a naive one is read as UTC). Normalised to UTC
    here because PostgreSQL refuses offsets past 15:59 that ISO 8601 allows."""
    bad = ValidationError({name: f"{text!r} is not an ISO 8601 date or date-time."})
    try:
        value = parse_datetime(text)
        if value is None and (day := parse_date(text)) is not None:
            value = datetime.combine(day, time.min)
        if value is None:
            raise bad
        return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
    except (ValueError, OverflowError):  # well-formed but impossible, or out of range in UTC
        raise bad from None


def time_range(request: Request, default_days: int = 30) -> tuple[datetime, datetime]:
    params = request.query_params
    end = parse_time("end", params["end"]) if params.get("end") else datetime.now(UTC)
    start = (parse_time("start", params["start"]) if params.get("start")
             else end - timedelta(days=default_days))
    if end <= start:
        raise ValidationError({"end": "end must come after start."})
    return start, end


def key_param(request: Request) -> int | None:
    raw = request.query_params.get("key")
    if not raw:
        return None
    if not raw.isdigit():
        raise ValidationError({"key": "key must be an API key id (a number)."})
    return int(raw)


def filter_usage(qs: QuerySet[_M], request: Request, time_field: str) -> QuerySet[_M]:
    params = request.query_params
    start = parse_time("start", params["start"]) if params.get("start") else None
    end = parse_time("end", params["end"]) if params.get("end") else None
    if start is not None and end is not None and end <= start:  # [] would hide the mistake
        raise ValidationError({"end": "end must come after start."})
    if start is not None:
        qs = qs.filter(**{f"{time_field}__gte": start})
    if end is not None:
        qs = qs.filter(**{f"{time_field}__lt": end})
    if params.get("model"):
        qs = qs.filter(model_name=params["model"])
    if (key := key_param(request)) is not None:
        qs = qs.filter(api_key_id=key)
    return qs
