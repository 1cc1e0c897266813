"""Projects and budgets: the tenant's spending limits, in money or tokens, at four levels.

A **project** groups a tenant's keys ("production", "staging") and may narrow the models they
use. A **budget** caps what one level spends per period: the tenant, a project, a key, or an
end user (the request's ``user`` / ``safety_identifier``, or the tenant's chosen header). A
budget of level ``end_user`` with no ``end_user`` is the tenant's default for every end user;
one naming an end user overrides that default for them.

Budgets are enforced at admission, in the same Lua script as the token buckets
(``serving.budgets``, ``serving/lua/admit.lua``; docs/adr/0022-budgets-reserve-then-settle.md):
this module only holds what the owners configured.
"""

from __future__ import annotations

from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models


class Project(models.Model):
    """A group of one tenant's keys, with its own allowed models and budgets."""

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE,
                               related_name="projects")
    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=64)
    allowed_models = models.ManyToManyField(
        "catalog.ServedModel", blank=True, related_name="+",
        help_text="Empty = every model the tenant may use. A key in the project uses the "
                  "models both it and its project allow.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant", "name"]
        constraints = [models.UniqueConstraint(fields=["tenant", "slug"],
                                               name="one_project_slug_per_tenant")]

    def __str__(self) -> str:
        return self.name


class Budget(models.Model):
    """A cap on what one level spends in one period (UTC), in money or in tokens."""

    class Level(models.TextChoices):
        TENANT = "tenant", "Tenant"
        PROJECT = "project", "Project"
        KEY = "key", "Key"
        END_USER = "end_user", "End user"

    class Metric(models.TextChoices):
        MONEY = "money", "Money"
        TOKENS = "tokens", "Tokens (input + output)"

    class Period(models.TextChoices):
        DAY = "day", "Day (UTC)"
        WEEK = "week", "Week (Monday, UTC)"
        MONTH = "month", "Calendar month (UTC)"
        LIFETIME = "lifetime", "Lifetime"

    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE,
                               related_name="budgets")
    level = models.CharField(max_length=16, choices=Level.choices)
    project = models.ForeignKey(Project, null=True, blank=True, on_delete=models.CASCADE,
                                related_name="budgets")
    api_key = models.ForeignKey("tenants.ApiKey", null=True, blank=True,
                                on_delete=models.CASCADE, related_name="budgets")
    end_user = models.CharField(
        max_length=256, blank=True, default="",
        help_text="Level end user: blank = the default for every end user of the tenant; "
                  "set = an override for this end user.",
    )
    metric = models.CharField(max_length=8, choices=Metric.choices, default=Metric.MONEY)
    limit = models.DecimalField(max_digits=20, decimal_places=6,
                                validators=[MinValueValidator(Decimal(0))],
                                help_text="Money in the currency, or tokens.")
    currency = models.CharField(max_length=3, default="USD",
                                help_text="Money budgets count usage priced in this currency.")
    period = models.CharField(max_length=8, choices=Period.choices, default=Period.MONTH)
    enabled = models.BooleanField(default=True)
    # Soft thresholds (50/80/100 %): the highest one notified in ``notified_period``.
    notified_period = models.CharField(max_length=16, blank=True, default="", editable=False)
    notified_pct = models.PositiveSmallIntegerField(default=0, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["tenant", "level", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "level", "project", "api_key", "end_user", "metric", "period"],
                name="one_budget_per_scope_metric_period", nulls_distinct=False),
        ]

    def __str__(self) -> str:
        return f"{self.scope_text}: {self.limit_text} per {self.period}"

    @property
    def scope_text(self) -> str:
        if self.level == self.Level.PROJECT and self.project is not None:
            return f"project {self.project.name}"
        if self.level == self.Level.KEY and self.api_key is not None:
            return f"key {self.api_key.name} ({self.api_key.masked})"
        if self.level == self.Level.END_USER:
            return f"end user {self.end_user}" if self.end_user else "each end user"
        return "tenant"

    @property
    def limit_text(self) -> str:
        if self.metric == self.Metric.TOKENS:
            return f"{self.limit:,.0f} tokens"
        return f"{self.limit:,.2f} {self.currency}"

    def clean(self) -> None:
        wants = {self.Level.PROJECT: "project", self.Level.KEY: "api_key"}
        errors: dict[str, str] = {}
        for level, name in wants.items():
            if (self.level == level) != bool(getattr(self, f"{name}_id")):
                errors[name] = f"Set {name} exactly when the level is {level}."
        if self.end_user and self.level != self.Level.END_USER:
            errors["end_user"] = "Only an end-user budget names an end user."
        if self.metric == self.Metric.TOKENS and self.limit != int(self.limit or 0):
            errors["limit"] = "A token budget is a whole number of tokens."
        for name in ("project", "api_key"):
            owner = getattr(self, name) if getattr(self, f"{name}_id") else None
            if owner is not None and owner.tenant_id != self.tenant_id:
                errors[name] = f"The {name} belongs to another tenant."
        if errors:
            raise ValidationError(errors)
