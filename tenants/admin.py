"""Django admin for the platform operator: tenants, quotas, keys, members, models and pools.

A key is issued from the API key "add" page. The plaintext is rendered once, in the response to
that POST (no redirect, so it never passes through the session or a cookie), with
``Cache-Control: no-store``; afterwards only its prefix and last four characters are shown.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.validators import MinValueValidator
from django.db.models import Count, Q, QuerySet
from django.forms.models import BaseInlineFormSet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone

from tenants.admin_planner import CapacityPlanAdminMixin
from tenants.keys import assign_secret
from tenants.limits import key_cap_errors, quota_errors, quota_table
from tenants.models import (
    LIMIT_FIELDS,
    QUOTA_FIELDS,
    ApiKey,
    Membership,
    Pool,
    Quota,
    ServedModel,
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


@admin.register(ServedModel)
class ServedModelAdmin(admin.ModelAdmin):
    list_display = ["name", "engine_model_id", "max_model_len", "kv_kib_per_token", "created_at"]
    search_fields = ["name", "engine_model_id"]
    readonly_fields = ["kv_kib_per_token"]

    @admin.display(description="KV cache per token (KiB)")
    def kv_kib_per_token(self, obj: ServedModel) -> str:
        return f"{obj.kv_bytes_per_token / 1024:g}"


@admin.register(Pool)
class PoolAdmin(CapacityPlanAdminMixin, admin.ModelAdmin):
    list_display = ["name", "model", "region", "backend", "max_sequences", "kv_cache_tokens",
                    "dedicated_to", "enabled"]
    list_filter = ["enabled", "backend", "region", "model"]
    search_fields = ["name", "model__name", "region", "dedicated_to__slug"]
    list_select_related = ["model", "dedicated_to"]
    autocomplete_fields = ["dedicated_to"]


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
    fields = ["name", "masked_key", "key_hash", "created_at", "last_used_at", "expires_at",
              "revoked_at"]
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="key")
    def masked_key(self, obj: ApiKey) -> str:
        return obj.masked


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "status", "tier", "region", "content_logging", "key_count",
                    "created_at"]
    list_filter = ["status", "tier", "region", "content_logging"]
    search_fields = ["name", "slug"]
    prepopulated_fields = {"slug": ["name"]}
    readonly_fields = ["created_at", "updated_at"]
    list_select_related = ["tier"]
    inlines = [QuotaInline, ApiKeyInline]
    actions = ["suspend_selected", "activate_selected"]

    def get_queryset(self, request: HttpRequest) -> QuerySet[Tenant]:
        live = Q(api_keys__revoked_at__isnull=True)
        return super().get_queryset(request).annotate(_keys=Count("api_keys", filter=live))

    @admin.display(description="live keys", ordering="_keys")
    def key_count(self, obj: Tenant) -> int:
        return obj._keys  # type: ignore[attr-defined]

    @admin.action(description="Suspend selected tenants (403 on every key)")
    def suspend_selected(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        self._set_status(request, queryset, Tenant.Status.SUSPENDED)

    @admin.action(description="Reactivate selected tenants")
    def activate_selected(self, request: HttpRequest, queryset: QuerySet[Tenant]) -> None:
        self._set_status(request, queryset, Tenant.Status.ACTIVE)

    def _set_status(self, request: HttpRequest, queryset: QuerySet[Tenant], status: str) -> None:
        changed = [t for t in queryset if t.status != status]
        for tenant in changed:
            tenant.set_status(status)  # per row, so the save signal tells every gateway
        self.message_user(request, f"{len(changed)} tenant(s) now {status}.", messages.SUCCESS)


# --- API keys ------------------------------------------------------------------------------

class KeyStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("active", "Active"), ("expired", "Expired"), ("revoked", "Revoked")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> QuerySet[ApiKey]:
        now = timezone.now()
        if self.value() == "active":
            return queryset.usable(now)
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
        cleaned = super().clean()
        tenant = cleaned.get("tenant") or getattr(self.instance, "tenant", None)
        if tenant is not None:
            caps = {f: cleaned.get(f) for f in LIMIT_FIELDS}
            for field, message in key_cap_errors(caps, quota_table(tenant)).items():
                self.add_error(field, message)
        return cleaned


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    form = ApiKeyForm
    list_display = ["masked_key", "name", "tenant", "created_at", "last_used_at", "expires_at",
                    "state"]
    list_filter = [KeyStateFilter, "tenant__status", "tenant__tier", "created_at"]
    search_fields = ["name", "prefix", "tenant__slug", "tenant__name"]
    list_select_related = ["tenant"]
    autocomplete_fields = ["tenant"]
    filter_horizontal = ["allowed_models"]
    actions = ["revoke_selected"]
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
        if obj.revoked_at:
            return "revoked"
        return "active" if obj.is_usable() else "expired"

    def save_model(self, request: HttpRequest, obj: ApiKey, form: Any, change: bool) -> None:
        if not change:
            # Held on the request only, for the one response that shows it.
            request._issued_plaintext = assign_secret(obj)  # type: ignore[attr-defined]
            obj.created_by = request.user  # type: ignore[assignment]
        super().save_model(request, obj, form, change)

    def response_add(self, request: HttpRequest, obj: ApiKey, *args: Any) -> HttpResponse:
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "API key issued",
            "api_key": obj,
            "plaintext": request._issued_plaintext,  # type: ignore[attr-defined]
        }
        response = TemplateResponse(request, "admin/tenants/apikey/issued.html", context)
        response["Cache-Control"] = "no-store"
        return response

    @admin.action(description="Revoke selected keys")
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        count = queryset.revoke()
        self.message_user(request, f"Revoked {count} key(s).", messages.SUCCESS)


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "role", "created_at"]
    list_filter = ["role", "tenant__status", "tenant__tier"]
    search_fields = ["user__username", "user__email", "tenant__slug", "tenant__name"]
    list_select_related = ["user", "tenant"]
    autocomplete_fields = ["user", "tenant"]


# Identity providers and client-certificate bindings (issue 8) have their own admin module.
from tenants import admin_signin  # noqa: E402, F401
