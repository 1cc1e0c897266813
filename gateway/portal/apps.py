from django.apps import AppConfig


class PortalConfig(AppConfig):
    name = "gateway.portal"
    label = "portal"
    verbose_name = "Tenant portal"
    default_auto_field = "django.db.models.BigAutoField"
