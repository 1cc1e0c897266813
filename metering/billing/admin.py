"""Billing admin. Prices and what was billed are history: a price can be corrected or deleted
only before it takes effect, and nothing else here can be deleted (a deleted past price would
silently re-cost past statements; add a new price from the next hour instead)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, TypeVar

from django import forms
from django.contrib import admin
from django.db.models import Model
from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from catalog.models import ServedModel
from metering.billing.budget_status import status_of
from metering.billing.models import AlertEvent, ExportJob, Price, SpendAlert
from metering.billing.money import format_money, format_rate
from metering.billing.reports import build_report
from tenants.admin import TenantAdmin
from tenants.models import Budget, Tenant

_M = TypeVar("_M", bound=Model)


class NoDelete(admin.ModelAdmin[_M]):
    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnly(NoDelete[_M]):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


# Currencies offered for a price: ISO 4217 codes in common use (the minor-unit table knows the
# rest); a typed "usd" or "US$" is not a currency the reports could total.
CURRENCIES = sorted({"USD", "EUR", "GBP", "CHF", "JPY", "CAD", "AUD", "NZD", "SEK", "NOK", "DKK",
                     "PLN", "CZK", "INR", "CNY", "SGD", "HKD", "KRW", "BRL", "MXN", "ZAR"})


def next_hour() -> datetime:
    """The default start of a new price: the next full hour (prices start on the hour, and a
    price starting in the past would re-cost usage already reported)."""
    return timezone.now().replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)


class PriceForm(forms.ModelForm[Price]):
    model_name = forms.ChoiceField(label="Model", help_text="A served model's public name.")
    currency = forms.ChoiceField(choices=[(c, c) for c in CURRENCIES], initial="USD")
    effective_from = forms.DateTimeField(
        initial=next_hour, label="Takes effect at (UTC)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local", "step": 3600},
                                   format="%Y-%m-%dT%H:%M"),
        help_text="On the hour, in the future (the next full hour by default). A price can be "
                  "corrected or deleted until then; after, it is history.")

    class Meta:
        model = Price
        fields = ["model_name", "currency", "input_per_mtok", "cached_input_per_mtok",
                  "output_per_mtok", "effective_from"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        names = list(ServedModel.objects.order_by("name").values_list("name", flat=True))
        current = self.instance.model_name if self.instance.pk else ""
        if current and current not in names:  # a retired model's price stays editable
            names.append(current)
        field = self.fields["model_name"]
        assert isinstance(field, forms.ChoiceField)
        field.choices = [("", "---------")] + [(n, n) for n in names]

    def clean_effective_from(self) -> datetime:
        value: datetime = self.cleaned_data["effective_from"]
        if value <= timezone.now():
            raise forms.ValidationError(
                "A new or corrected price takes effect in the future: past usage was already "
                "costed. Pick the next full hour or later.")
        return value


@admin.register(Price)
class PriceAdmin(admin.ModelAdmin[Price]):
    form = PriceForm
    list_display = ("model_name", "effective_from", "currency", "input_display",
                    "cached_input_display", "output_display", "state")
    list_filter = ("currency", "model_name")

    def has_change_permission(self, request: HttpRequest, obj: Price | None = None) -> bool:
        in_effect = obj is not None and obj.in_effect()
        return not in_effect and super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Price | None = None) -> bool:
        # Only one price at a time (never the bulk action), and only before it takes effect.
        return obj is not None and not obj.in_effect() and super().has_delete_permission(
            request, obj)

    @admin.display(description="input / 1M tokens", ordering="input_per_mtok")
    def input_display(self, obj: Price) -> str:
        return format_rate(obj.input_per_mtok, obj.currency)

    @admin.display(description="cached input / 1M tokens", ordering="cached_input_per_mtok")
    def cached_input_display(self, obj: Price) -> str:
        return format_rate(obj.cached_input_per_mtok, obj.currency)

    @admin.display(description="output / 1M tokens", ordering="output_per_mtok")
    def output_display(self, obj: Price) -> str:
        return format_rate(obj.output_per_mtok, obj.currency)

    @admin.display(description="state")
    def state(self, obj: Price) -> str:
        return "in effect or past" if obj.in_effect() else "scheduled (can be corrected)"


@admin.register(SpendAlert)
class SpendAlertAdmin(admin.ModelAdmin[SpendAlert]):
    list_display = ("tenant", "api_key", "metric", "period", "threshold_display", "hard_cap",
                    "enabled", "last_fired_period")
    list_filter = ("metric", "period", "hard_cap", "enabled", "tenant")
    list_select_related = ("tenant", "api_key")
    autocomplete_fields = ("tenant", "api_key")
    raw_id_fields = ("created_by",)

    @admin.display(description="threshold", ordering="threshold")
    def threshold_display(self, obj: SpendAlert) -> str:
        return obj.threshold_text


@admin.register(AlertEvent)
class AlertEventAdmin(ReadOnly[AlertEvent]):
    list_display = ("alert", "period", "value_display", "emailed", "webhook_status", "suspended",
                    "fired_at")
    list_filter = ("alert__tenant",)
    list_select_related = ("alert__tenant", "alert__api_key")

    @admin.display(description="value", ordering="value")
    def value_display(self, obj: AlertEvent) -> str:
        return obj.value_text


@admin.register(ExportJob)
class ExportJobAdmin(ReadOnly[ExportJob]):
    list_display = ("id", "tenant", "start", "end", "format", "status", "rows_done", "rows_total",
                    "created_at")
    list_filter = ("status", "format", "tenant")
    list_select_related = ("tenant",)




class TenantWithUsageAdmin(TenantAdmin):
    """The tenant page with this month's usage and spend: billing knows prices, tenants don't."""

    overview = ["issue_key", "month_usage", "members"]

    @admin.display(description="This month")
    def month_usage(self, obj: Tenant) -> SafeString:
        now = timezone.now()
        start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        totals = build_report(start, now + timedelta(hours=1), tenant=obj, group_by=()).totals
        requests = sum(t.requests for t in totals)
        tokens_in = sum(t.input_tokens for t in totals)
        tokens_out = sum(t.output_tokens for t in totals)
        spend = ", ".join(format_money(t.amount, t.currency)
                          for t in totals if t.requests and t.currency)
        if any(t.requests and not t.currency for t in totals):
            spend = f"{spend} + unpriced usage" if spend else "unpriced usage only"
        return format_html(
            '<span id="month-usage">{} requests · {} input tokens · {} output tokens · {}</span>'
            " (since {}, UTC)", f"{requests:,}", f"{tokens_in:,}", f"{tokens_out:,}",
            spend or "no spend", f"{start:%Y-%m-%d}")


admin.site.unregister(Tenant)
admin.site.register(Tenant, TenantWithUsageAdmin)


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin[Budget]):
    list_display = ["tenant", "scope", "limit_shown", "period", "this_period", "enabled"]
    list_filter = ["level", "metric", "period", "enabled", "tenant"]
    search_fields = ["tenant__slug", "end_user", "api_key__name", "project__name"]
    autocomplete_fields = ["tenant"]
    raw_id_fields = ["project", "api_key"]
    list_select_related = ["tenant", "project", "api_key"]

    @admin.display(description="scope")
    def scope(self, obj: Budget) -> str:
        return obj.scope_text

    @admin.display(description="limit")
    def limit_shown(self, obj: Budget) -> str:
        return obj.limit_text

    @admin.display(description="this period")
    def this_period(self, obj: Budget) -> str:
        status = status_of(obj, timezone.now())
        spent = (f"{status.spent:,.2f} {obj.currency}" if obj.metric == "money"
                 else f"{status.spent:,.0f} tokens")
        return f"{spent} ({status.percent}%)" + (" · over budget" if status.over else "")
