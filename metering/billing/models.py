"""Prices, export jobs and spend alerts.

Money is ``Decimal`` everywhere: a report's cost is a sum of exact products (tokens x price per
million tokens), so summing by tenant, by key or by record gives the same figure to the last
digit, and rounding happens only where a figure is displayed.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any, TypedDict

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from metering.billing import webhooks
from metering.billing.money import format_money
from metering.billing.webhooks import new_secret
from tenants.models import ApiKey, Tenant


def validate_webhook_url(value: str) -> None:
    """https, a public address (today's DNS answer); checked again on every delivery."""
    if value:
        try:
            webhooks.check_url(value)
        except webhooks.UnsafeWebhook as exc:
            raise ValidationError(str(exc), code="unsafe_webhook") from None

class _Digits(TypedDict):
    max_digits: int
    decimal_places: int
    validators: list[MinValueValidator]


PRICE_DIGITS: _Digits = {"max_digits": 14, "decimal_places": 6,
                         "validators": [MinValueValidator(0)]}


class Price(models.Model):
    """Prices per million tokens of one model, from ``effective_from`` until the next row's."""

    model_name = models.CharField(max_length=128, help_text="The public model name (`model`).")
    currency = models.CharField(max_length=3, default="USD")
    input_per_mtok = models.DecimalField(**PRICE_DIGITS, help_text="Per million input tokens.")
    cached_input_per_mtok = models.DecimalField(
        **PRICE_DIGITS, help_text="Per million input tokens served from the prefix cache."
    )
    output_per_mtok = models.DecimalField(**PRICE_DIGITS, help_text="Per million output tokens.")
    effective_from = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["model_name", "-effective_from"]
        constraints = [
            models.UniqueConstraint(
                fields=["model_name", "effective_from"], name="one_price_per_model_and_start"
            )
        ]

    def __str__(self) -> str:
        return f"{self.model_name} from {self.effective_from:%Y-%m-%d %H:%M} ({self.currency})"

    def clean(self) -> None:
        # Rollups are hourly, so a price can only take effect on the hour: a mid-hour change
        # would make a report's cost differ from the same usage costed record by record.
        start = self.effective_from
        if start and (start.minute or start.second or start.microsecond):
            raise ValidationError({"effective_from": "A price takes effect on the hour (UTC)."})

    def in_effect(self, now: datetime | None = None) -> bool:
        """A price that has taken effect is history: past usage was costed with it, so it is
        never changed nor deleted (add a new price from the next hour instead)."""
        return self.effective_from <= (now or timezone.now())

    def cost(self, prompt: int, cached: int, completion: int) -> Decimal:
        """Exact cost; ``prompt`` includes ``cached`` (OpenAI's convention), billed at two rates."""
        fresh = max(prompt - cached, 0)
        return (
            fresh * self.input_per_mtok + cached * self.cached_input_per_mtok
            + completion * self.output_per_mtok
        ) / Decimal(1_000_000)


class ExportJob(models.Model):
    """A usage report too large to stream: built by a Celery task, progress kept here."""

    class Status(models.TextChoices):
        PENDING = "pending", "Waiting for a worker"
        RUNNING = "running", "Running"
        DONE = "done", "Ready"
        FAILED = "failed", "Failed"

    class Format(models.TextChoices):
        CSV = "csv", "CSV"
        XLSX = "xlsx", "Excel (XLSX)"

    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="+",
        help_text="Empty = every tenant (platform admins only).",
    )
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    start = models.DateTimeField()
    end = models.DateTimeField()
    group_by = models.CharField(max_length=64, default="tenant,key,model")
    format = models.CharField(max_length=8, choices=Format.choices, default=Format.CSV)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    rows_total = models.PositiveIntegerField(default=0)
    rows_done = models.PositiveIntegerField(default=0)
    file_path = models.CharField(max_length=500, blank=True)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"export {self.pk} ({self.status})"

    @property
    def progress(self) -> int:
        if self.status == self.Status.DONE:
            return 100
        return int(100 * self.rows_done / self.rows_total) if self.rows_total else 0

    @property
    def filename(self) -> str:
        scope = self.tenant.slug if self.tenant is not None else "all-tenants"
        return f"usage-{scope}-{self.start:%Y%m%d%H}-{self.end:%Y%m%d%H}.{self.format}"


class SpendAlert(models.Model):
    """A threshold on a tenant's (or one key's) tokens or money per day or month."""

    class Metric(models.TextChoices):
        TOKENS = "tokens", "Tokens (input + output)"
        MONEY = "money", "Money"

    class Period(models.TextChoices):
        DAY = "day", "Per day (UTC)"
        MONTH = "month", "Per month (UTC)"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.CASCADE, related_name="+",
        help_text="Empty = the whole tenant.",
    )
    metric = models.CharField(max_length=8, choices=Metric.choices, default=Metric.MONEY)
    period = models.CharField(max_length=8, choices=Period.choices, default=Period.MONTH)
    threshold = models.DecimalField(
        max_digits=20, decimal_places=6, validators=[MinValueValidator(Decimal("0.000001"))]
    )
    currency = models.CharField(
        max_length=3, default="USD",
        help_text="Money alerts: the currency of the threshold; only usage priced in it counts.",
    )
    webhook_url = models.URLField(
        blank=True, validators=[validate_webhook_url],
        help_text="Optional: an https URL POSTed a signed JSON body on firing.",
    )
    # Signs each delivery (metering.billing.webhooks): shown to the tenant once, at creation.
    webhook_secret = models.CharField(max_length=64, blank=True, editable=False)
    hard_cap = models.BooleanField(
        default=False,
        help_text="On crossing, suspend the key (or the tenant for a tenant-wide alert).",
    )
    enabled = models.BooleanField(default=True)
    # The period it last fired in ("2026-11-30" or "2026-11"): claimed by one conditional
    # UPDATE, so two checkers running at once notify once.
    last_fired_period = models.CharField(max_length=10, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant", "id"]

    def save(self, *args: Any, **kwargs: Any) -> None:
        if self.webhook_url and not self.webhook_secret:
            self.webhook_secret = new_secret()
            self.secret_is_new = True  # the caller shows it to the tenant, once
        super().save(*args, **kwargs)

    def rotate_secret(self) -> str:
        """A new signing secret, effective for the next delivery; shown to the caller once."""
        self.webhook_secret = new_secret()
        self.secret_is_new = True
        SpendAlert.objects.filter(pk=self.pk).update(webhook_secret=self.webhook_secret)
        return self.webhook_secret

    def __str__(self) -> str:
        scope = self.api_key.name if self.api_key is not None else "tenant"
        return f"{self.tenant} {scope}: {self.threshold_text} per {self.period}"

    @property
    def is_money(self) -> bool:
        return self.metric == self.Metric.MONEY

    def value_text(self, value: Decimal) -> str:
        """``1,234.50 USD`` or ``1,234 tokens``: what an email or a page says."""
        return format_money(value, self.currency) if self.is_money else f"{value:,.0f} tokens"

    @property
    def threshold_text(self) -> str:
        return self.value_text(self.threshold)


class AlertEvent(models.Model):
    """One firing of a spend alert: what was measured, who was told, what was suspended."""

    alert = models.ForeignKey(SpendAlert, on_delete=models.CASCADE, related_name="events")
    period = models.CharField(max_length=10)
    value = models.DecimalField(max_digits=24, decimal_places=6)
    emailed = models.PositiveIntegerField(default=0, help_text="Owners emailed.")
    # A fixed vocabulary (metering.billing.webhooks.Outcome), never an error's text.
    webhook_status = models.CharField(max_length=64, blank=True)
    webhook_attempts = models.PositiveSmallIntegerField(default=0)
    suspended = models.BooleanField(default=False)
    fired_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-fired_at"]
        constraints = [
            models.UniqueConstraint(fields=["alert", "period"], name="one_event_per_alert_period")
        ]

    @property
    def value_text(self) -> str:
        return self.alert.value_text(self.value)
