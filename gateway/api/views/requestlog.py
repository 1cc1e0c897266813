"""The tenant's request log (``metering.requestlog``): recent requests, refusals included."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import CursorPagination
from rest_framework.request import Request

from gateway.api import serializers as s
from gateway.api.filters import USAGE_PARAMS, filter_usage
from gateway.api.views.base import TenantScoped
from metering.billing.pricing import PriceBook
from metering.models import RequestLogEntry

STATUSES = ("ok", "cancelled", "error", "expired", "refused")
REQUEST_LOG_PARAMS = [
    *USAGE_PARAMS,
    OpenApiParameter("status", str, enum=list(STATUSES), description="Only this outcome; "
                     "`refused` = never admitted (a 429, or a request refused before it ran)."),
    OpenApiParameter("code", str, description="Only this error code (e.g. rate_limit_exceeded)."),
    OpenApiParameter("end_user", str, description="Only this end user (`user` / "
                     "`safety_identifier` of the request)."),
    OpenApiParameter("project", int, description="Only this project id."),
]


class RequestLogPagination(CursorPagination):
    ordering = ("-at", "-id")
    page_size = 100
    page_size_query_param = "limit"
    max_page_size = 1000


def filter_log(qs: QuerySet[RequestLogEntry], request: Request) -> QuerySet[RequestLogEntry]:
    """The usage filters (time, model, key) and the log's own (status, code, end user, project)."""
    qs = filter_usage(qs, request, "at")
    params = request.query_params
    if (status := params.get("status")):
        if status not in STATUSES:
            raise ValidationError({"status": f"status must be one of {', '.join(STATUSES)}."})
        qs = qs.filter(status=status)
    if params.get("code"):
        qs = qs.filter(error_code=params["code"])
    if params.get("end_user"):
        qs = qs.filter(end_user=params["end_user"])
    if (project := params.get("project")):
        if not project.isdigit():
            raise ValidationError({"project": "project must be a project id (a number)."})
        qs = qs.filter(project_id=int(project))
    return qs


@extend_schema_view(list=extend_schema(parameters=REQUEST_LOG_PARAMS))
class RequestLogViewSet(mixins.ListModelMixin, TenantScoped[RequestLogEntry]):
    """Recent requests, newest first: outcome, error code, tokens, cost, timings; no content.
    A member sees the requests of their own keys."""

    capability = "usage"
    serializer_class = s.RequestLogEntrySerializer
    pagination_class = RequestLogPagination

    def get_queryset(self) -> QuerySet[RequestLogEntry]:
        if self.fake():
            return RequestLogEntry.objects.none()
        qs = filter_log(RequestLogEntry.objects.filter(tenant=self.tenant), self.request)
        if (ids := self.own_key_ids()) is not None:
            qs = qs.filter(api_key_id__in=ids)
        return qs

    def get_serializer_context(self) -> dict[str, Any]:
        return {**super().get_serializer_context(), "prices": PriceBook()}
