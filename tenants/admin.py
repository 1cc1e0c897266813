"""Django admin for the platform operator: tenants, quotas, keys and members (models and routes:
``catalog.admin``; pools: ``workers.admin``).

A key is issued from the API key "add" page (or a tenant's "Issue key" link). The POST parks the
plaintext in the operator's server-side session and redirects (POST-redirect-GET); the "issued"
page takes it out of the session as it renders it, with ``Cache-Control: no-store``, so a
reload shows nothing and never mints a second key. Afterwards only the prefix and last four
characters are shown. Keys are revoked (after a confirmation), never deleted.
"""

from __future__ import annotations

from typing import Any

from axes.admin import AccessAttemptAdmin
from axes.models import AccessAttempt
from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.core.validators import MinValueValidator
from django.db.models import Count, Q, QuerySet
from django.forms.models import BaseInlineFormSet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from infra import sealed_once
from tenants.admin_onboarding import TenantOnboardingMixin
from tenants.api_keys import assign_secret
from tenants.limits import key_cap_errors, quota_errors, quota_table
from tenants.models import (
    LIMIT_FIELDS,
    QUOTA_FIELDS,
    ApiKey,
    ApiKeyQuerySet,
    Membership,
    Project,
    Quota,
    Tenant,
    Tier,
)


@admin.register(Tier)
class TierAdmin(admin.ModelAdmin):
    list_display = ["name", "weight", "tenant_count"]
    search_fields = ["name"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Tier]:
        return super().get_queryset(request).annotate(_tenants=Count("tenants"))

    @admin.display(description="tenants", ordering="_tenants")
    def tenant_count(self, obj: Tier) -> int:
        return obj._tenants  # type: ignore[attr-defined]


admin.site.site_header = "Inference gateway administration"
admin.site.site_title = "Inference gateway"
admin.site.index_title = "Operations"


# --- tenants, with their quotas and keys inline -----------------------------------------------

def require_positive(form: forms.BaseForm, fields: Any) -> None:
    """One clear "at least 1" rule for count fields (the DB column alone would allow 0)."""
    for name in fields:
        field = form.fields.get(name)
        if isinstance(field, forms.IntegerField) and not isinstance(field, forms.FloatField):
            field.min_value = 1
            field.validators = [v for v in field.validators
                                if not isinstance(v, MinValueValidator)]
            field.validators.append(MinValueValidator(1))
            field.widget.attrs["min"] = 1


class QuotaInlineForm(forms.ModelForm):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        require_positive(self, QUOTA_FIELDS)
        # The formset checks rows against each other (an override against the default being
        # edited beside it), so the model only checks each field on its own.
        self.instance.defer_cross_row_checks = True


class QuotaFormSet(BaseInlineFormSet):
    def clean(self) -> None:
        super().clean()
        live = [f for f in self.forms if f.has_changed() or f.instance.pk]
        live = [f for f in live if getattr(f, "cleaned_data", None)
                and not f.cleaned_data.get("DELETE")]
        defaults = [f for f in live if f.cleaned_data.get("model") is None]
        base = row_values_from(defaults[0]) if defaults else None
        for form in live:
            is_default = form.cleaned_data.get("model") is None
            errors = quota_errors(row_values_from(form), base=None if is_default else base)
            for field, message in errors.items():
                form.add_error(field if field in form.fields else None, message)


def row_values_from(form: forms.ModelForm) -> dict[str, Any]:
    return {f: form.cleaned_data.get(f) for f in QUOTA_FIELDS}


class QuotaInline(admin.StackedInline):
    model = Quota
    form = QuotaInlineForm
    formset = QuotaFormSet
    extra = 0
    autocomplete_fields = ["model"]
    fieldsets = [
        (None, {"fields": ["model"]}),
        ("Tokens per minute", {"fields": [("input_tpm", "input_burst"),
                                          ("output_tpm", "output_burst")]}),
        ("Per request and in flight", {"fields": [
            ("max_context_tokens", "max_output_tokens"),
            ("concurrent_requests", "open_streams"),
            ("ttft_deadline_s", "total_deadline_s"),
        ]}),
    ]


class ApiKeyInline(admin.TabularInline):
    """Keys are issued from the API key page (to show the secret once); here they are listed."""

    model = ApiKey
    extra = 0
    can_delete = False
    show_change_link = True
    # No key_hash: 64 unbreakable characters made the tenant page wider than a 1366 px screen
    # (the key's own page shows it).
    fields = readonly_fields = ("name", "masked_key", "created_at", "last_used_at",
                                "expires_at", "revoked_at")

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="key")
    def masked_key(self, obj: ApiKey) -> str:
        return obj.masked


@admin.register(Tenant)
class TenantAdmin(TenantOnboardingMixin, admin.ModelAdmin):
    list_display = ["name", "slug", "status", "tier", "region", "home_cell", "extra_cells",
                    "content_logging", "key_count", "created_at"]
    list_filter = ["status", "tier", "region", "home_cell", "content_logging"]
    search_fields = ["name", "slug"]
    prepopulated_fields = {"slug": ["name"]}
    # Content logging and the response cache store content: the tenant's owner switches them,
    # with their audit rows (review 3, N9), never staff here.
    readonly_fields = ["content_logging", "response_cache", "created_at", "updated_at"]
    list_select_related = ["tier"]
    inlines = [QuotaInline, ApiKeyInline]
    actions = ["suspend_selected", "activate_selected"]
    # metering.billing.admin adds "This month" (usage and spend) above these.
    overview = ["issue_key", "members"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return [*super().get_readonly_fields(request, obj), *(self.overview if obj else [])]

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = [(name, {**opts, "fields": [f for f in opts["fields"]
                                                if f not in self.overview]})
                     for name, opts in super().get_fieldsets(request, obj)]
        return [("Overview", {"fields": self.overview}), *fieldsets] if obj else fieldsets

    @admin.display(description="API keys")
    def issue_key(self, obj: Tenant) -> SafeString:
        add = reverse("admin:tenants_apikey_add") + f"?tenant={obj.pk}"
        keys = reverse("admin:tenants_apikey_changelist") + f"?tenant__id__exact={obj.pk}"
        return format_html('<a class="button" id="issue-key" href="{}">Issue key</a> '
                           '<a href="{}">All keys of this tenant</a>', add, keys)

    @admin.display(description="Members")
    def members(self, obj: Tenant) -> SafeString:
        rows = format_html_join("", '<tr><td><a href="{}">{}</a></td><td>{}</td><td>{}</td></tr>', (
            (reverse("admin:tenants_membership_change", args=[m.pk]), m.user.get_username(),
             m.user.email, m.get_role_display())
            for m in obj.memberships.select_related("user").order_by("role", "user__username")))
        add = reverse("admin:tenants_membership_add") + f"?tenant={obj.pk}"
        return format_html(
            '<table id="tenant-members"><thead><tr><th>User</th><th>Email</th><th>Role</th></tr>'
            '</thead><tbody>{}</tbody></table><p><a href="{}">Add a member</a></p>',
            rows or format_html('<tr><td colspan="3">{}</td></tr>', "No members yet."), add)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Tenant]:
        live = Q(api_keys__revoked_at__isnull=True)
        return super().get_queryset(request).annotate(_keys=Count("api_keys", filter=live))

    @admin.display(description="live keys", ordering="_keys")
    def key_count(self, obj: Tenant) -> int:
        return obj._keys  # type: ignore[attr-defined]

    # Every action names its permission: without one, Django offers it to anyone who may view
    # the list (review 3, N4: staff with only view_tenant suspended tenants).
    @admin.action(description="Suspend selected tenants (403 on every key)",
                  permissions=["change"])
    def suspend_selected(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        self._set_status(request, queryset, Tenant.Status.SUSPENDED)

    @admin.action(description="Reactivate selected tenants", permissions=["change"])
    def activate_selected(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        self._set_status(request, queryset, Tenant.Status.ACTIVE)

    def _set_status(self, request: HttpRequest, queryset: QuerySet[Tenant], status: str) -> None:
        changed = [t for t in queryset if t.status != status]
        for tenant in changed:
            tenant.set_status(status)  # per row, so the save signal tells every gateway
        self.message_user(request, f"{len(changed)} tenant(s) now {status}.", messages.SUCCESS)


# --- API keys ------------------------------------------------------------------------------

ISSUED_SESSION_KEY = "admin_issued_key"

class KeyStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("active", "Active"), ("over_budget", "Over budget"), ("expired", "Expired"),
                ("revoked", "Revoked")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> QuerySet[ApiKey]:
        assert isinstance(queryset, ApiKeyQuerySet)  # ApiKey's manager makes these
        now = timezone.now()
        if self.value() == "active":
            return queryset.usable(now).filter(over_budget_at__isnull=True)
        if self.value() == "over_budget":
            return queryset.usable(now).filter(over_budget_at__isnull=False)
        if self.value() == "expired":
            return queryset.filter(revoked_at__isnull=True, expires_at__lte=now)
        if self.value() == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        return queryset


class ApiKeyForm(forms.ModelForm):
    class Meta:
        model = ApiKey
        fields = ["tenant", "name", "allowed_models", "expires_at", *LIMIT_FIELDS]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        require_positive(self, LIMIT_FIELDS)

    def clean_expires_at(self) -> Any:
        expires_at = self.cleaned_data.get("expires_at")
        if expires_at and expires_at <= timezone.now() and "expires_at" in self.changed_data:
            raise forms.ValidationError("The expiry must be in the future.")
        return expires_at

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        tenant = cleaned.get("tenant") or getattr(self.instance, "tenant", None)
        if tenant is not None:
            caps = {f: cleaned.get(f) for f in LIMIT_FIELDS}
            for field, message in key_cap_errors(caps, quota_table(tenant)).items():
                self.add_error(field, message)
        return cleaned


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    form = ApiKeyForm
    change_form_template = "admin/tenants/apikey/change_form.html"
    list_display = ["masked_key", "name", "tenant", "created_at", "last_used_at", "expires_at",
                    "state"]
    list_filter = [KeyStateFilter, "tenant", "tenant__status", "tenant__tier", "created_at"]
    search_fields = ["name", "prefix", "tenant__slug", "tenant__name"]
    list_select_related = ["tenant"]
    autocomplete_fields = ["tenant"]
    filter_horizontal = ["allowed_models"]
    actions = ["revoke_selected", "resume_selected"]
    show_full_result_count = False  # keys can be many; skip the extra COUNT(*)
    limit_fieldsets = ("Limits under the tenant's (empty = the tenant's)", {"fields": [
        ("input_tpm", "output_tpm"), ("concurrent_requests", "open_streams"),
        "max_output_tokens"]})

    def get_fieldsets(self, request: HttpRequest, obj: ApiKey | None = None) -> Any:
        if obj is None:
            return [(None, {"fields": ["tenant", "name", "allowed_models", "expires_at"]}),
                    self.limit_fieldsets]
        return [
            (None, {"fields": ["tenant", "name", "allowed_models", "expires_at"]}),
            ("Key", {"fields": ["masked_key", "key_hash", "pepper_version", "created_by",
                                "created_at", "last_used_at", "revoked_at"]}),
            self.limit_fieldsets,
        ]

    def get_readonly_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        if obj is None:
            return []
        return ["tenant", "masked_key", "key_hash", "pepper_version", "created_by", "created_at",
                "last_used_at", "revoked_at"]

    @admin.display(description="key", ordering="prefix")
    def masked_key(self, obj: ApiKey) -> str:
        return obj.masked

    @admin.display(description="state")
    def state(self, obj: ApiKey) -> str:
        return obj.state()

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a key is revoked, never deleted: its usage and audit trail point at it

    def get_urls(self) -> list[Any]:
        wrap = self.admin_site.admin_view
        return [
            path("<int:pk>/issued/", wrap(self.issued_view), name="tenants_apikey_issued"),
            path("<int:pk>/revoke/", wrap(self.revoke_view), name="tenants_apikey_revoke"),
            *super().get_urls(),
        ]

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        if not change:
            obj.created_by = request.user  # type: ignore[assignment]
            plaintext = assign_secret(obj)
            super().save_model(request, obj, form, change)
            # Parked, sealed, for the one GET that shows it (issued_view); response_add hands
            # the browser the key (infra.sealed_once), so the session store never holds it.
            request._issued_key = {"pk": obj.pk, "plaintext": plaintext}  # type: ignore[attr-defined]
            return
        super().save_model(request, obj, form, change)

    def response_add(self, request: HttpRequest, obj: ApiKey, *args: Any) -> HttpResponse:
        response = HttpResponseRedirect(reverse("admin:tenants_apikey_issued", args=[obj.pk]))
        issued: dict[str, Any] = request._issued_key  # type: ignore[attr-defined]
        return sealed_once.park(request, response, ISSUED_SESSION_KEY, issued)

    def issued_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        api_key = get_object_or_404(ApiKey.objects.select_related("tenant"), pk=pk)
        parked = sealed_once.take(request, ISSUED_SESSION_KEY) or {}
        if parked.get("pk") != api_key.pk:
            self.message_user(request, "That key was shown once and is not shown again.",
                              messages.WARNING)
            return sealed_once.forget_key(redirect("admin:tenants_apikey_change", api_key.pk))
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "API key issued",
            "api_key": api_key,
            "plaintext": parked["plaintext"],
        }
        response = TemplateResponse(request, "admin/tenants/apikey/issued.html", context)
        response["Cache-Control"] = "no-store"
        return sealed_once.forget_key(response)

    def revoke_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        api_key = get_object_or_404(ApiKey.objects.select_related("tenant"), pk=pk)
        if not self.has_change_permission(request, api_key):
            raise PermissionDenied
        if request.method == "POST":
            if api_key.revoke():
                self.message_user(request, f"Key {api_key.masked} revoked: it stops working "
                                  "within a second, everywhere.", messages.SUCCESS)
            return redirect("admin:tenants_apikey_change", api_key.pk)
        return self._confirm_revoke(request, [api_key], single=True)

    def _confirm_revoke(self, request: HttpRequest, keys: list[ApiKey],
                        single: bool = False) -> TemplateResponse:
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts, "title": "Revoke API keys?", "keys": keys, "single": single,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/tenants/apikey/revoke_confirm.html", context)

    @admin.action(description="Revoke selected keys…", permissions=["change"])
    def revoke_selected(self, request: HttpRequest,
                        queryset: ApiKeyQuerySet) -> TemplateResponse | None:
        if request.POST.get("confirmed") != "yes":  # first ask, listing what will stop working
            return self._confirm_revoke(request, list(queryset.select_related("tenant")))
        count = queryset.revoke()
        self.message_user(request, f"Revoked {count} key(s).", messages.SUCCESS)
        return None

    @admin.action(description="Resume selected keys that are over budget",
                  permissions=["change"])
    def resume_selected(self, request: HttpRequest, queryset: ApiKeyQuerySet) -> None:
        count = sum(key.resume() for key in queryset.filter(over_budget_at__isnull=False))
        self.message_user(request, f"Resumed {count} key(s) that were over budget.",
                          messages.SUCCESS)


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "role", "created_at"]
    list_filter = ["role", "tenant", "tenant__status", "tenant__tier"]
    search_fields = ["user__username", "user__email", "tenant__slug", "tenant__name"]
    list_select_related = ["user", "tenant"]
    autocomplete_fields = ["user", "tenant"]




# --- projects and budgets (docs/adr/0022) ------------------------------------------------------

@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin[Project]):
    list_display = ["name", "slug", "tenant", "created_at"]
    list_filter = ["tenant"]
    search_fields = ["name", "slug", "tenant__slug"]
    autocomplete_fields = ["tenant"]
    filter_horizontal = ["allowed_models"]


# Identity providers and client-certificate bindings, and who may act in a tenant (grants,
# invitations, management tokens), have their own admin modules.
from tenants import admin_access, admin_fallbacks, admin_signin  # noqa: E402, F401

# --- sign-in lockouts (django-axes) ---------------------------------------------------------

class GuardedAccessAttemptAdmin(AccessAttemptAdmin):  # type: ignore[misc]
    """axes' admin, its one action requiring the delete permission (it deletes rows) instead
    of being offered to whoever may view the lockouts."""

    @admin.action(description="Clean up expired attempts", permissions=["delete"])
    def cleanup_expired_attempts(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        super().cleanup_expired_attempts(request, queryset)


if admin.site.is_registered(AccessAttempt):  # importing axes.admin registered it
    admin.site.unregister(AccessAttempt)
    admin.site.register(AccessAttempt, GuardedAccessAttemptAdmin)
