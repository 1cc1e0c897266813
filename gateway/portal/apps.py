from django.apps import AppConfig


class PortalConfig(AppConfig):
    name = "gateway.portal"
    label = "portal"
    verbose_name = "Tenant portal"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_logged_in

        from gateway.portal.views.invitations import accept_pending_on_sign_in

        user_logged_in.connect(accept_pending_on_sign_in, dispatch_uid="portal-invitations")
