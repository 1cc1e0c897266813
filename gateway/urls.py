from django.contrib import admin
from django.urls import include, path

from gateway import health
from gateway.portal import errors

handler403 = "gateway.portal.errors.forbidden"
handler404 = "gateway.portal.errors.not_found"
handler500 = "gateway.portal.errors.server_error"

urlpatterns = [
    path("", errors.landing, name="landing"),
    path("favicon.ico", errors.favicon),
    path("admin/", admin.site.urls),
    path("healthz", health.healthz, name="healthz"),
    path("portal/", include("gateway.portal.urls")),
    path("api/", include("gateway.api.urls")),
    path("breakglass/", include("gateway.contentlog.urls")),
    path("sso/", include("gateway.sso")),
]
