from django.contrib.auth import views as auth_views
from django.urls import path, reverse_lazy

from gateway.portal.lockout import UnlockingPasswordResetConfirmView
from gateway.portal.password_reset import LimitedPasswordResetView
from gateway.portal.views import (
    budgets,
    content_logging,
    finance,
    home,
    invitations,
    keys,
    members,
    overview,
    playground,
    projects,
    requestlog,
    tokens,
    usage,
)

app_name = "portal"

urlpatterns = [
    path("login/", home.PortalLoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("invitation/<str:secret>/", invitations.invitation_page, name="invitation"),
    path("password-reset/", LimitedPasswordResetView.as_view(
        template_name="portal/password_reset.html",
        email_template_name="portal/password_reset_email.txt",
        subject_template_name="portal/password_reset_subject.txt",
        success_url=reverse_lazy("portal:password_reset_done")), name="password_reset"),
    path("password-reset/sent/", auth_views.PasswordResetDoneView.as_view(
        template_name="portal/password_reset_sent.html"), name="password_reset_done"),
    path("password-reset/<uidb64>/<token>/", UnlockingPasswordResetConfirmView.as_view(
        template_name="portal/password_reset_confirm.html",
        success_url=reverse_lazy("portal:password_reset_complete")),
        name="password_reset_confirm"),
    path("password-reset/done/", auth_views.PasswordResetCompleteView.as_view(
        template_name="portal/password_reset_complete.html"), name="password_reset_complete"),
    path("", home.index, name="index"),
    path("no-tenant/", home.no_tenant, name="no_tenant"),
    path("switch/", home.switch, name="switch"),
    path("start/", overview.overview_page, name="overview"),
    path("keys/", keys.key_list, name="keys"),
    path("keys/new/", keys.key_create, name="key_create"),
    path("keys/new/done/", keys.key_created, name="key_created"),
    path("keys/<int:pk>/edit/", keys.key_edit, name="key_edit"),
    path("keys/<int:pk>/revoke/", keys.key_revoke, name="key_revoke"),
    path("keys/<int:pk>/rotate/", keys.key_rotate, name="key_rotate"),
    path("keys/<int:pk>/resume/", keys.key_resume, name="key_resume"),
    path("usage/", usage.usage_page, name="usage"),
    path("quotas/", usage.quotas_page, name="quotas"),
    path("requests/", requestlog.request_log_page, name="requests"),
    path("content-logging/", content_logging.content_logging_page, name="content_logging"),
    path("playground/", playground.playground_page, name="playground"),
    path("playground/key/", playground.playground_key_view, name="playground_key"),
    path("reports/", finance.reports_page, name="reports"),
    path("reports/statement/", finance.statement_page, name="statement"),
    path("exports/<int:pk>/", finance.export_page, name="export"),
    path("exports/<int:pk>/status/", finance.export_status, name="export_status"),
    path("exports/<int:pk>/download/", finance.export_download, name="export_download"),
    path("alerts/", finance.alerts_page, name="alerts"),
    path("budgets/", budgets.budgets_page, name="budgets"),
    path("budgets/<int:pk>/delete/", budgets.budget_delete, name="budget_delete"),
    path("projects/", projects.projects_page, name="projects"),
    path("projects/<int:pk>/edit/", projects.project_edit, name="project_edit"),
    path("alerts/<int:pk>/delete/", finance.alert_delete, name="alert_delete"),
    path("alerts/<int:pk>/rotate-secret/", finance.alert_rotate_secret,
         name="alert_rotate_secret"),
    path("members/", members.members_page, name="members"),
    path("members/<int:pk>/", members.member_change, name="member_change"),
    path("invitations/<int:pk>/resend/", members.invitation_resend, name="invitation_resend"),
    path("invitations/<int:pk>/revoke/", members.invitation_revoke, name="invitation_revoke"),
    path("tokens/", tokens.tokens_page, name="tokens"),
    path("tokens/created/", tokens.token_created, name="token_created"),
    path("tokens/<int:pk>/revoke/", tokens.token_revoke, name="token_revoke"),
]
