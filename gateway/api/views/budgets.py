"""Projects and budgets of a tenant (docs/adr/0022). Reads: projects for every role, budgets
(with this period's spend) for owners and billing; changes: owners."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.request import Request

from gateway.api import serializers as s
from gateway.api.views.base import TenantScoped
from metering.billing import budget_export
from tenants.models import Budget, Project


class ProjectViewSet(viewsets.ModelViewSet[Project], TenantScoped[Project]):
    """Projects group a tenant's keys and may narrow the models they use."""

    capability = "projects"
    write_capability = "manage_budgets"
    serializer_class = s.ProjectSerializer

    def get_queryset(self) -> QuerySet[Project]:
        if self.fake():
            return Project.objects.none()
        return Project.objects.filter(tenant=self.tenant).prefetch_related("allowed_models")

    def perform_create(self, serializer: Any) -> None:
        serializer.save(tenant=self.tenant)


class BudgetViewSet(viewsets.ModelViewSet[Budget], TenantScoped[Budget]):
    """Budgets in money or tokens per day, week, month (UTC) or lifetime, at the tenant, a
    project, a key or an end user; each answer says this period's spend and projection."""

    capability = "budgets"
    write_capability = "manage_budgets"
    serializer_class = s.BudgetSerializer

    def get_queryset(self) -> QuerySet[Budget]:
        if self.fake():
            return Budget.objects.none()
        return Budget.objects.filter(tenant=self.tenant).select_related("project", "api_key")

    def perform_create(self, serializer: Any) -> None:
        serializer.save(tenant=self.tenant)

    @extend_schema(responses={(200, "text/csv"): OpenApiTypes.STR})
    @action(detail=False, methods=["get"])
    def export(self, request: Request, *args: Any, **kwargs: Any) -> HttpResponse:
        """Budget against actual per level, as CSV (finance)."""
        response = HttpResponse(budget_export.csv_text(self.tenant, timezone.now()),
                                content_type="text/csv")
        response["Content-Disposition"] = (
            f'attachment; filename="budgets-{self.tenant.slug}.csv"')
        return response
