from django.contrib.auth import views as auth_views
from django.urls import path

from gateway.portal.views import (
    content_logging,
    finance,
    home,
    keys,
    members,
    playground,
    tokens,
    usage,
)

app_name = "portal"

urlpatterns = [
    path("login/", home.PortalLoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", home.index, name="index"),
    path("no-tenant/", home.no_tenant, name="no_tenant"),
    path("switch/", home.switch, name="switch"),
    path("keys/", keys.key_list, name="keys"),
    path("keys/new/", keys.key_create, name="key_create"),
    path("keys/<int:pk>/revoke/", keys.key_revoke, name="key_revoke"),
    path("keys/<int:pk>/rotate/", keys.key_rotate, name="key_rotate"),
    path("usage/", usage.usage_page, name="usage"),
    path("quotas/", usage.quotas_page, name="quotas"),
    path("content-logging/", content_logging.content_logging_page, name="content_logging"),
    path("playground/", playground.playground_page, name="playground"),
    path("playground/key/", playground.playground_key, name="playground_key"),
    path("reports/", finance.reports_page, name="reports"),
    path("reports/statement/", finance.statement_page, name="statement"),
    path("exports/<int:pk>/", finance.export_page, name="export"),
    path("exports/<int:pk>/status/", finance.export_status, name="export_status"),
    path("exports/<int:pk>/download/", finance.export_download, name="export_download"),
    path("alerts/", finance.alerts_page, name="alerts"),
    path("alerts/<int:pk>/delete/", finance.alert_delete, name="alert_delete"),
    path("alerts/<int:pk>/rotate-secret/", finance.alert_rotate_secret,
         name="alert_rotate_secret"),
    path("members/", members.members_page, name="members"),
    path("members/<int:pk>/", members.member_change, name="member_change"),
    path("tokens/", tokens.tokens_page, name="tokens"),
    path("tokens/<int:pk>/revoke/", tokens.token_revoke, name="token_revoke"),
]
