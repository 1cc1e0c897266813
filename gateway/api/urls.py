from django.http import HttpRequest, JsonResponse
from django.urls import include, path, re_path
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter, SimpleRouter

from gateway.api import views
from gateway.api.offline_docs import redoc_bundle, same_origin_only

platform = DefaultRouter()
platform.register("tenants", views.TenantViewSet, basename="tenant")
platform.register("models", views.ServedModelViewSet, basename="model")
platform.register("pools", views.PoolViewSet, basename="pool")
platform.register("prices", views.PriceViewSet, basename="price")
platform.register("routes", views.RouteViewSet, basename="route")
platform.register("reports/usage", views.PlatformReportView, basename="platform-report")

scoped = SimpleRouter()
scoped.register("keys", views.ApiKeyViewSet, basename="key")
scoped.register("members", views.MembershipViewSet, basename="member")
scoped.register("invitations", views.InvitationViewSet, basename="invitation")
scoped.register("quotas", views.QuotaViewSet, basename="quota")
scoped.register("usage", views.UsageRecordViewSet, basename="usage")
scoped.register("rollups", views.UsageRollupViewSet, basename="rollup")
scoped.register("requests", views.RequestLogViewSet, basename="request-log")
scoped.register("reports", views.ReportViewSet, basename="report")
scoped.register("exports", views.ExportJobViewSet, basename="export")
scoped.register("alerts", views.SpendAlertViewSet, basename="alert")
scoped.register("tokens", views.ManagementTokenViewSet, basename="token")
scoped.register("content-logging", views.ContentLoggingViewSet, basename="content-logging")
scoped.register("response-cache", views.ResponseCacheViewSet, basename="response-cache")
scoped.register("projects", views.ProjectViewSet, basename="project")
scoped.register("budgets", views.BudgetViewSet, basename="budget")
scoped.register("fallbacks", views.TenantFallbackViewSet, basename="fallback")

@csrf_exempt  # it changes nothing; a CSRF 403 page would hide the 404
def not_found(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"error": {"message": f"Unknown URL: {request.method} {request.path}",
                                   "type": "not_found_error", "param": None,
                                   "code": "not_found"}}, status=404)


app_name = "api"

urlpatterns = [
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("docs/", same_origin_only(SpectacularSwaggerView.as_view(url_name="api:schema")),
         name="docs"),
    # The OpenAI-compatible /v1 API first (what most readers want), then the management API.
    path("redoc/inference/", same_origin_only(SpectacularRedocView.as_view(
        url="/v1/openapi.json", template_name="drf_spectacular/redoc.html")),
         name="redoc_inference"),
    path("redoc/bundle.js", redoc_bundle, name="redoc_bundle"),
    path("redoc/", same_origin_only(SpectacularRedocView.as_view(url_name="api:schema")),
         name="redoc"),
    path("tenants/<slug:tenant>/", include(scoped.urls)),
    path("", include(platform.urls)),
    # Anything else under /api/ (an id the router's pattern refuses, a typo) answers the same
    # JSON error shape as the views, not Django's HTML page.
    re_path(r"", not_found),
]

