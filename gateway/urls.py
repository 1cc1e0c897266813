from django.contrib import admin
from django.urls import path

from gateway import health

urlpatterns = [
    path("admin/", admin.site.urls),
    path("healthz", health.healthz, name="healthz"),
]
