"""API keys: list, create (shown once), revoke with confirmation, rotate with a grace period."""

from __future__ import annotations

from datetime import timedelta

from django.contrib import messages
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.utils import timezone

from catalog.visibility import models_for
from gateway.portal.forms import KeyEditForm, KeyForm, RotateForm
from gateway.portal.playground import is_playground_key
from gateway.portal.snippets import base_url, snippets
from gateway.portal.tenancy import TenantRequest, tenant_view
from gateway.portal.usage import per_key
from gateway.portal.views.base import page, secret_page, secret_redirect, take_secret
from tenants import roles
from tenants.api_keys import KeyNotRotatable, issue_key, rotate_key
from tenants.models import ApiKey, ApiKeyQuerySet


def visible_keys(request: TenantRequest) -> ApiKeyQuerySet:
    keys = ApiKey.objects.filter(tenant=request.tenant)
    if not roles.can(request.role, "all_keys"):
        keys = keys.filter(created_by=request.user)
    return keys


@tenant_view("keys")
def key_list(request: TenantRequest) -> HttpResponse:
    keys = list(visible_keys(request).select_related("created_by", "project")
                .prefetch_related("allowed_models"))
    now = timezone.now()
    month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    usage = per_key(request.tenant, month, now + timedelta(hours=1), [k.pk for k in keys])
    for key in keys:
        key.month_usage = usage.get(key.pk)  # type: ignore[attr-defined]
        key.playground = is_playground_key(key)  # type: ignore[attr-defined]
    return page(request, "portal/keys.html", {"keys": keys, "now": now, "month": month})


@tenant_view("keys")
def key_create(request: TenantRequest) -> HttpResponse:
    form = KeyForm(request.POST or None, tenant=request.tenant)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        key, plaintext = issue_key(
            request.tenant, data["name"], allowed_models=list(data["allowed_models"]),
            expires_at=data["expires_at"], created_by=request.user, project=data.get("project"),
            **form.caps(),
        )
        return secret_redirect(request, "portal:key_created",
                               {"key_id": key.pk, "plaintext": plaintext})
    return page(request, "portal/key_form.html", {"form": form})


@tenant_view("keys")
def key_created(request: TenantRequest) -> HttpResponse:
    """The one GET that shows a new key; a reload finds the session empty and says so."""
    parked = take_secret(request) or {}
    key_id: int | None = parked.get("key_id")
    key = visible_keys(request).filter(pk=key_id).first() if key_id is not None else None
    if key is None:
        messages.info(request, "That key was shown once and is not shown again.")
        return redirect("portal:keys")
    rotated_id: int | None = parked.get("rotated_id")
    rotated = visible_keys(request).filter(pk=rotated_id).first() \
        if rotated_id is not None else None
    plaintext: str = parked["plaintext"]
    allowed = list(key.allowed_models.all()) or list(models_for(request.tenant)[:1])
    example = allowed[0].name if allowed else "MODEL"
    return secret_page(request, "portal/key_created.html", {
        "key": key, "plaintext": plaintext, "rotated": rotated, "example_model": example,
        "snippets": snippets(base_url(request), example, plaintext)})


@tenant_view("keys")
def key_edit(request: TenantRequest, pk: int) -> HttpResponse:
    key = get_object_or_404(visible_keys(request).filter(revoked_at__isnull=True), pk=pk)
    form = KeyEditForm(request.POST or None, key=key)
    if request.method == "POST" and form.is_valid():
        form.save()
        messages.success(request, f"Key {key.masked} saved: gateways apply it within a second.")
        return redirect("portal:keys")
    return page(request, "portal/key_form.html", {"form": form, "key": key})


@tenant_view("keys")
def key_revoke(request: TenantRequest, pk: int) -> HttpResponse:
    key = get_object_or_404(visible_keys(request), pk=pk)
    if request.method == "POST":
        if key.revoke():
            messages.success(request, f"Key {key.masked} revoked: it stops working at once.")
        return redirect("portal:keys")
    return page(request, "portal/key_revoke.html", {"key": key})


@tenant_view("keys")
def key_rotate(request: TenantRequest, pk: int) -> HttpResponse:
    old = get_object_or_404(visible_keys(request).usable().filter(rotated_at__isnull=True), pk=pk)
    form = RotateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            new, plaintext = rotate_key(old, form.grace(), created_by=request.user)
        except KeyNotRotatable as exc:  # revoked or expired since the page was shown
            messages.error(request, str(exc))
            return redirect("portal:keys")
        return secret_redirect(request, "portal:key_created",
                               {"key_id": new.pk, "plaintext": plaintext, "rotated_id": old.pk})
    return page(request, "portal/key_rotate.html", {"key": old, "form": form})


@tenant_view("keys")
def key_resume(request: TenantRequest, pk: int) -> HttpResponse:
    """POST: lift a spend alert's hard cap from a key that is over budget (owners only)."""
    key = get_object_or_404(visible_keys(request), pk=pk)
    if request.method != "POST" or not roles.can(request.role, "all_keys"):
        return HttpResponse("Only an owner resumes a key that is over budget.", status=403)
    if key.resume():
        messages.success(request, f"{key.name} is resumed: its requests are admitted again.")
    return redirect("portal:keys")
