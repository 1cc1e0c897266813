"""Reports, statements, exports and spend alerts."""

from __future__ import annotations

from datetime import UTC
from typing import Any

from django.db.models import QuerySet
from django.http import FileResponse, Http404
from django.http.response import HttpResponseBase
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from gateway.api import access
from gateway.api import serializers as s
from gateway.api.filters import TIME_PARAMS
from gateway.api.schema import OneObjectSchema
from gateway.api.views.base import FILE_PARAM, TenantScoped
from gateway.api.views.platform import report_answer
from metering.billing import alerts, exports, reports
from metering.billing.downloads import XLSX_TYPE, report_response
from metering.billing.models import AlertEvent, ExportJob, SpendAlert


# Any: no model behind it; its serializer shapes a computed report.
class ReportViewSet(TenantScoped[Any]):
    """Usage reports (JSON, CSV or XLSX) and monthly statements."""

    capability = "reports"
    serializer_class = s.ReportSerializer
    schema = OneObjectSchema()  # list answers one report, not a page

    @extend_schema(parameters=[*TIME_PARAMS, OpenApiParameter("group_by", str),
                               OpenApiParameter("model", str),
                               FILE_PARAM],
                   responses={200: s.ReportSerializer})
    def list(self, request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
        return report_answer(request, self.tenant)

    @extend_schema(parameters=[OpenApiParameter("month", str, OpenApiParameter.PATH,
                                                description="YYYY-MM"),
                               FILE_PARAM],
                   responses={200: s.ReportSerializer})
    @action(detail=False, url_path=r"statements/(?P<month>\d{4}-\d{2})")
    def statement(self, request: Request, *args: Any, month: str,
                  **kwargs: Any) -> HttpResponseBase:
        year, number = (int(p) for p in month.split("-"))
        if not 1 <= number <= 12:
            raise ValidationError({"month": "month must be YYYY-MM."})
        start, end = reports.month_range(year, number, UTC)
        report = reports.build_report(start, end, tenant=self.tenant, group_by=("model", "key"))
        fmt = request.query_params.get("file", "")
        if fmt in ("csv", "xlsx"):
            return report_response(report, fmt, f"statement-{self.tenant.slug}-{month}")
        return Response(s.ReportSerializer(report).data)


class ExportJobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin,
                       mixins.CreateModelMixin, TenantScoped[ExportJob]):
    """Background report exports: create, watch progress, download when done."""

    capability = "reports"
    serializer_class = s.ExportJobSerializer

    def get_queryset(self) -> QuerySet[ExportJob]:
        if self.fake():
            return ExportJob.objects.none()
        return ExportJob.objects.filter(tenant=self.tenant)

    def perform_create(self, serializer: Any) -> None:
        data = serializer.validated_data
        try:
            group_by = ",".join(reports.parse_group_by(data.get("group_by", "tenant,key,model")))
        except ValueError as exc:
            raise ValidationError({"group_by": str(exc)}) from exc
        if data["end"] <= data["start"]:
            raise ValidationError({"end": "end must come after start."})
        serializer.instance = exports.queue_export(
            tenant=self.tenant, user=access.user_for_audit(self.request), start=data["start"],
            end=data["end"], group_by=group_by, fmt=data.get("format", "csv"),
        )

    @extend_schema(responses={(200, "text/csv"): OpenApiTypes.BINARY,
                              (200, XLSX_TYPE): OpenApiTypes.BINARY})
    @action(detail=True)
    def download(self, request: Request, *args: Any, **kwargs: Any) -> FileResponse:
        job = self.get_object()
        if job.status != ExportJob.Status.DONE or not job.file_path:
            raise Http404("This export has no file yet.")
        return FileResponse(open(job.file_path, "rb"), as_attachment=True,
                            filename=job.filename)


class SpendAlertViewSet(viewsets.ModelViewSet[SpendAlert], TenantScoped[SpendAlert]):
    """Spend alerts of the tenant (owners and billing)."""

    capability = "alerts"
    serializer_class = s.SpendAlertSerializer

    def get_queryset(self) -> QuerySet[SpendAlert]:
        if self.fake():
            return SpendAlert.objects.none()
        return SpendAlert.objects.filter(tenant=self.tenant)

    def perform_create(self, serializer: Any) -> None:
        try:
            serializer.instance = alerts.create_alert(
                self.tenant, created_by=access.user_for_audit(self.request),
                **serializer.validated_data)
        except alerts.TooManyAlerts as exc:
            raise ValidationError({"non_field_errors": [str(exc)]}) from None

    @extend_schema(request=None, responses={200: s.SpendAlertSerializer})
    @action(detail=True, methods=["post"], url_path="rotate-secret")
    def rotate_secret(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        """A new webhook signing secret, returned in this answer only."""
        alert = self.get_object()
        if not alert.webhook_url:
            raise ValidationError({"webhook_url": ["This alert has no webhook."]})
        alert.rotate_secret()
        return Response(s.SpendAlertSerializer(alert, context=self.get_serializer_context()).data)

    @extend_schema(responses={200: s.AlertEventSerializer(many=True)})
    @action(detail=False)
    def events(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        events = AlertEvent.objects.filter(alert__tenant=self.tenant)
        # Not self.paginate_queryset: that is typed for this viewset's own model (alerts).
        paginator = self.paginator
        assert paginator is not None  # REST_FRAMEWORK sets a default pagination class
        page = paginator.paginate_queryset(events, request, view=self)
        return paginator.get_paginated_response(s.AlertEventSerializer(page, many=True).data)
