"""Management API tokens: create (shown once), list, revoke. Owners only."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.utils import timezone
from django.views.decorators.http import require_POST

from gateway.portal.forms import TokenForm
from gateway.portal.tenancy import TenantRequest, tenant_view
from gateway.portal.views.base import page, secret_page, secret_redirect, take_secret
from tenants.management_tokens import issue_token
from tenants.models import ManagementToken


@tenant_view("tokens")
def tokens_page(request: TenantRequest) -> HttpResponse:
    tenant = request.tenant
    form = TokenForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        days = form.cleaned_data["expires_in_days"]
        token, plaintext = issue_token(
            tenant, form.cleaned_data["name"], form.cleaned_data["role"],
            created_by=request.user, expires_at=timezone.now() + timedelta(days=days),
        )
        return secret_redirect(request, "portal:token_created",
                               {"token_id": token.pk, "plaintext": plaintext})
    tokens = ManagementToken.objects.filter(tenant=tenant).select_related("created_by")
    usable = set(ManagementToken.objects.filter(tenant=tenant).usable().values_list("pk",
                                                                                   flat=True))
    return page(request, "portal/tokens.html", {"form": form, "tokens": tokens,
                                                "usable": usable, "now": timezone.now()})


@tenant_view("tokens")
def token_created(request: TenantRequest) -> HttpResponse:
    """The one GET that shows a new token; a reload finds the session empty and says so."""
    parked = take_secret(request) or {}
    token_id: int | None = parked.get("token_id")
    token = ManagementToken.objects.filter(tenant=request.tenant, pk=token_id).first() \
        if token_id is not None else None
    if token is None:
        messages.info(request, "That token was shown once and is not shown again.")
        return redirect("portal:tokens")
    return secret_page(request, "portal/token_created.html",
                       {"token": token, "plaintext": parked["plaintext"]})


@tenant_view("tokens")
@require_POST
def token_revoke(request: TenantRequest, pk: int) -> HttpResponse:
    token = get_object_or_404(ManagementToken, pk=pk, tenant=request.tenant)
    ManagementToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )
    messages.success(request, f"Token {token.masked} revoked.")
    return redirect("portal:tokens")
