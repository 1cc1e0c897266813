from django.contrib import admin
from django.urls import include, path

from gateway import health

urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", health.healthz, name="healthz"),
    path("portal/", include("gateway.portal.urls")),
    path("api/", include("gateway.api.urls")),
    path("breakglass/", include("gateway.contentlog.urls")),
    path("sso/", include("gateway.sso")),
]
