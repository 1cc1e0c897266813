from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants, keys and quotas"

    def ready(self) -> None:
        from tenants import signals  # noqa: F401  (connects the auth-epoch receivers)
