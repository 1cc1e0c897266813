"""Management API viewsets, one module per capability."""

from gateway.api.views.budgets import BudgetViewSet, ProjectViewSet
from gateway.api.views.content_logging import ContentLoggingViewSet, ResponseCacheViewSet
from gateway.api.views.finance import ExportJobViewSet, ReportViewSet, SpendAlertViewSet
from gateway.api.views.keys import ApiKeyViewSet
from gateway.api.views.members import InvitationViewSet, MembershipViewSet, QuotaViewSet
from gateway.api.views.platform import (
    PlatformReportView,
    PoolViewSet,
    PriceViewSet,
    ServedModelViewSet,
    TenantViewSet,
)
from gateway.api.views.requestlog import RequestLogViewSet
from gateway.api.views.routes import RouteViewSet, TenantFallbackViewSet
from gateway.api.views.tokens import ManagementTokenViewSet
from gateway.api.views.usage import UsageRecordViewSet, UsageRollupViewSet

__all__ = [
    "ApiKeyViewSet", "BudgetViewSet", "ContentLoggingViewSet", "ExportJobViewSet",
    "InvitationViewSet", "ManagementTokenViewSet", "MembershipViewSet", "PlatformReportView",
    "PoolViewSet", "PriceViewSet", "ProjectViewSet", "QuotaViewSet", "ReportViewSet",
    "RequestLogViewSet", "ResponseCacheViewSet", "RouteViewSet", "ServedModelViewSet",
    "SpendAlertViewSet",
    "TenantFallbackViewSet", "TenantViewSet", "UsageRecordViewSet", "UsageRollupViewSet",
]
