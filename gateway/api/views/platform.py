"""Platform-wide endpoints: tenants; models, pools and prices (tenant members read what their
tenants may use); the all-tenant usage report. Each platform action needs its Django model
permission (``gateway.api.access``)."""

from __future__ import annotations

from typing import Any

from django.db.models import Model, Q, QuerySet
from django.http.response import HttpResponseBase
from drf_spectacular.utils import (
    OpenApiParameter,
    PolymorphicProxySerializer,
    extend_schema,
    extend_schema_view,
)
from rest_framework import viewsets
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import SAFE_METHODS
from rest_framework.request import Request
from rest_framework.response import Response

from catalog.models import Pool, ServedModel
from catalog.visibility import models_for
from gateway.api import access
from gateway.api import serializers as s
from gateway.api.filters import TIME_PARAMS, time_range
from gateway.api.schema import OneObjectSchema
from gateway.api.views.base import (
    FILE_PARAM,
    PlatformPermission,
    ReadForMembersWriteWithPermission,
)
from metering.billing import reports
from metering.billing.downloads import report_response
from metering.billing.models import Price
from metering.models import UsageRecord
from tenants.models import Tenant


def _staff_view(request: Request, model: type[Model]) -> bool:
    """Staff see the full rows: with the view permission, or on a write (which the permission
    class let through only with that write's permission)."""
    method = "GET" if request.method in SAFE_METHODS else request.method
    return access.has_platform_perm(request, model, method)


class TenantViewSet(viewsets.ModelViewSet[Tenant]):
    """Tenants: platform staff with the tenants.*_tenant permissions."""

    queryset = Tenant.objects.all()
    serializer_class = s.TenantSerializer
    permission_classes = [PlatformPermission]
    platform_model = Tenant
    lookup_field = "slug"


# Staff with the view permission get ``ServedModel``; everyone else ``PublicModel``.
MODEL_ANSWER = PolymorphicProxySerializer(
    component_name="ModelAnswer", serializers=[s.ServedModelSerializer, s.PublicModelSerializer],
    resource_type_field_name=None)


@extend_schema_view(list=extend_schema(responses=MODEL_ANSWER),
                    retrieve=extend_schema(responses=MODEL_ANSWER))
class ServedModelViewSet(viewsets.ModelViewSet[ServedModel]):
    """Models. A tenant member sees the models their tenants may use, without engine details;
    staff with the view permission see every model in full. Written with the permissions."""

    permission_classes = [ReadForMembersWriteWithPermission]
    platform_model = ServedModel
    lookup_field = "name"

    def _platform_reader(self) -> bool:
        return _staff_view(self.request, ServedModel)

    def get_queryset(self) -> QuerySet[ServedModel]:
        if getattr(self, "swagger_fake_view", False) or self._platform_reader():
            return ServedModel.objects.order_by("name")
        return models_for(access.tenant_ids(self.request))

    def get_serializer_class(self) -> type[s.ServedModelSerializer] | type[s.PublicModelSerializer]:
        if getattr(self, "swagger_fake_view", False) or self._platform_reader():
            return s.ServedModelSerializer
        return s.PublicModelSerializer


POOL_ANSWER = PolymorphicProxySerializer(
    component_name="PoolAnswer", serializers=[s.PoolSerializer, s.PublicPoolSerializer],
    resource_type_field_name=None)


@extend_schema_view(list=extend_schema(responses=POOL_ANSWER),
                    retrieve=extend_schema(responses=POOL_ANSWER))
class PoolViewSet(viewsets.ModelViewSet[Pool]):
    """Pools: shared ones and those dedicated to the caller's tenants; written by admins."""

    serializer_class = s.PoolSerializer
    permission_classes = [ReadForMembersWriteWithPermission]
    platform_model = Pool
    lookup_field = "name"

    def get_queryset(self) -> QuerySet[Pool]:
        if getattr(self, "swagger_fake_view", False):
            return Pool.objects.none()
        pools = Pool.objects.select_related("model", "dedicated_to").order_by("name")
        if _staff_view(self.request, Pool):
            return pools
        ids = access.tenant_ids(self.request)
        return pools.filter(Q(dedicated_to__isnull=True) | Q(dedicated_to_id__in=ids))

    def get_serializer_class(self) -> type[s.PoolSerializer] | type[s.PublicPoolSerializer]:
        if getattr(self, "swagger_fake_view", False) or _staff_view(self.request, Pool):
            return s.PoolSerializer
        return s.PublicPoolSerializer


class PriceViewSet(viewsets.ModelViewSet[Price]):
    """The price table: readable by any tenant member, written by platform admins."""

    queryset = Price.objects.all()
    serializer_class = s.PriceSerializer
    permission_classes = [ReadForMembersWriteWithPermission]
    platform_model = Price

    def get_queryset(self) -> QuerySet[Price]:
        """Without the platform permission, another tenant's dedicated model is not listed: to
        the caller it does not exist (review 3, old finding 8)."""
        prices = Price.objects.all()
        if access.has_platform_perm(self.request, Price, "GET"):
            return prices
        dedicated = set(ServedModel.objects.filter(pools__dedicated_to__isnull=False)
                        .values_list("name", flat=True))
        visible = set(models_for(access.tenant_ids(self.request)).values_list("name", flat=True))
        return prices.exclude(model_name__in=dedicated - visible)

    def perform_create(self, serializer: Any) -> None:
        Price(**serializer.validated_data).clean()
        serializer.save()

    # A price in effect costed past usage: only a scheduled one is corrected or deleted.
    def perform_update(self, serializer: Any) -> None:
        refuse_if_in_effect(serializer.instance)
        Price(**{**serializer.validated_data, "effective_from": serializer.validated_data.get(
            "effective_from", serializer.instance.effective_from)}).clean()
        serializer.save()

    def perform_destroy(self, instance: Price) -> None:
        refuse_if_in_effect(instance)
        instance.delete()


def refuse_if_in_effect(price: Price) -> None:
    if price.in_effect():
        raise ValidationError({"effective_from": "This price has taken effect and is history; "
                                                 "add a new price from the next hour instead."})


class PlatformReportView(viewsets.ViewSet):
    """Usage report across every tenant (staff with metering.view_usagerecord)."""

    permission_classes = [PlatformPermission]
    platform_model = UsageRecord
    schema = OneObjectSchema()  # list answers one report, not a page

    @extend_schema(parameters=[*TIME_PARAMS, OpenApiParameter("group_by", str),
                               FILE_PARAM],
                   responses={200: s.ReportSerializer})
    def list(self, request: Request) -> HttpResponseBase:
        return report_answer(request, tenant=None)


def report_answer(request: Request, tenant: Tenant | None) -> HttpResponseBase:
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
