"""Usage records and hourly rollups, filtered and cursor-paginated."""

from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins
from rest_framework.pagination import CursorPagination

from gateway.api import serializers as s
from gateway.api.filters import USAGE_PARAMS, filter_usage
from gateway.api.views.base import TenantScoped
from metering.models import UsageRecord, UsageRollup


class UsagePagination(CursorPagination):
    ordering = ("-finished_at", "-id")
    page_size = 100
    page_size_query_param = "limit"
    max_page_size = 1000


class RollupPagination(UsagePagination):
    ordering = ("-hour", "-id")


@extend_schema_view(list=extend_schema(parameters=[
    *USAGE_PARAMS, OpenApiParameter("end_user", str, description="One end user's requests.")]))
class UsageRecordViewSet(mixins.ListModelMixin, TenantScoped[UsageRecord]):
    """Raw usage records (one per request), newest first, cursor-paginated."""

    capability = "usage"
    serializer_class = s.UsageRecordSerializer
    pagination_class = UsagePagination

    def get_queryset(self) -> QuerySet[UsageRecord]:
        if self.fake():
            return UsageRecord.objects.none()
        qs = filter_usage(UsageRecord.objects.filter(tenant=self.tenant), self.request,
                          "finished_at")
        if end_user := self.request.query_params.get("end_user"):
            qs = qs.filter(end_user=end_user)  # one end user's requests (issue 27)
        if (ids := self.own_key_ids()) is not None:
            qs = qs.filter(api_key_id__in=ids)
        return qs


@extend_schema_view(list=extend_schema(parameters=USAGE_PARAMS))
class UsageRollupViewSet(mixins.ListModelMixin, TenantScoped[UsageRollup]):
    """Hourly rollups per key and model, newest hour first, cursor-paginated."""

    capability = "usage"
    serializer_class = s.UsageRollupSerializer
    pagination_class = RollupPagination

    def get_queryset(self) -> QuerySet[UsageRollup]:
        if self.fake():
            return UsageRollup.objects.none()
        qs = filter_usage(UsageRollup.objects.filter(tenant=self.tenant), self.request, "hour")
        if (ids := self.own_key_ids()) is not None:
            qs = qs.filter(api_key_id__in=ids)
        return qs
