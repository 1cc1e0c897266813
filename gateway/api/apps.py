from django.apps import AppConfig


class ApiConfig(AppConfig):
    name = "gateway.api"
    label = "management_api"
    verbose_name = "Management API"
