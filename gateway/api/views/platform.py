"""Platform-wide endpoints: tenants (admins); models, pools and prices (read for tenant members,
write for admins); the all-tenant usage report."""

from __future__ import annotations

from typing import Any

from django.db.models import Q, QuerySet
from django.http import HttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import viewsets
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from gateway.api import access
from gateway.api import serializers as s
from gateway.api.filters import TIME_PARAMS, time_range
from gateway.api.schema import OneObjectSchema
from gateway.api.views.base import FILE_PARAM, IsPlatformAdmin, ReadForMembersWriteForAdmins
from metering.billing import reports
from metering.billing.downloads import report_response
from metering.billing.models import Price
from tenants.models import Pool, ServedModel, Tenant


class TenantViewSet(viewsets.ModelViewSet):
    """Tenants: platform admins only."""

    queryset = Tenant.objects.all()
    serializer_class = s.TenantSerializer
    permission_classes = [IsPlatformAdmin]
    lookup_field = "slug"


class ServedModelViewSet(viewsets.ModelViewSet):
    """Models: readable by any tenant member, written by platform admins."""

    queryset = ServedModel.objects.all()
    serializer_class = s.ServedModelSerializer
    permission_classes = [ReadForMembersWriteForAdmins]
    lookup_field = "name"


class PoolViewSet(viewsets.ModelViewSet):
    """Pools: shared ones and those dedicated to the caller's tenants; written by admins."""

    serializer_class = s.PoolSerializer
    permission_classes = [ReadForMembersWriteForAdmins]
    lookup_field = "name"

    def get_queryset(self) -> QuerySet[Pool]:
        if getattr(self, "swagger_fake_view", False):
            return Pool.objects.none()
        pools = Pool.objects.select_related("model", "dedicated_to")
        ids = access.tenant_ids(self.request)
        if ids is None:
            return pools
        return pools.filter(Q(dedicated_to__isnull=True) | Q(dedicated_to_id__in=ids))


class PriceViewSet(viewsets.ModelViewSet):
    """The price table: readable by any tenant member, written by platform admins."""

    queryset = Price.objects.all()
    serializer_class = s.PriceSerializer
    permission_classes = [ReadForMembersWriteForAdmins]

    def perform_create(self, serializer: Any) -> None:
        Price(**serializer.validated_data).clean()
        serializer.save()


class PlatformReportView(viewsets.ViewSet):
    """Usage report across every tenant (platform admins)."""

    permission_classes = [IsPlatformAdmin]
    schema = OneObjectSchema()  # list answers one report, not a page

    @extend_schema(parameters=[*TIME_PARAMS, OpenApiParameter("group_by", str),
                               FILE_PARAM],
                   responses={200: s.ReportSerializer})
    def list(self, request: Request) -> HttpResponse:
        return report_answer(request, tenant=None)


def report_answer(request: Request, tenant: Tenant | None) -> HttpResponse:
    start, end = time_range(request)
    try:
        group_by = reports.parse_group_by(request.query_params.get("group_by", "tenant,key,model"))
    except ValueError as exc:
        raise ValidationError({"group_by": str(exc)}) from exc
    report = reports.build_report(start, end, tenant=tenant, group_by=group_by,
                                  model=request.query_params.get("model") or None)
    fmt = request.query_params.get("file", "")
    if fmt in ("csv", "xlsx"):
        scope = tenant.slug if tenant else "all-tenants"
        return report_response(report, fmt, f"usage-{scope}-{report.start:%Y%m%d%H}")
    if fmt:
        raise ValidationError({"file": "file must be csv or xlsx (or absent for JSON)."})
    return Response(s.ReportSerializer(report).data)
