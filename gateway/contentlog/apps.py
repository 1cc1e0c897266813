from django.apps import AppConfig


class ContentLogConfig(AppConfig):
    name = "gateway.contentlog"
    label = "contentlog"
    verbose_name = "Content log (encrypted, break-glass only)"
    default_auto_field = "django.db.models.BigAutoField"
