"""Serializers. Keys never expose their hash; a new key's plaintext appears once, on create."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.contrib.auth.models import User
from django.core.exceptions import ValidationError as DjangoValidationError
from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from catalog.models import Pool, ServedModel
from catalog.visibility import models_for
from metering.billing.budget_status import status_of
from metering.billing.models import AlertEvent, ExportJob, Price, SpendAlert
from metering.billing.pricing import PriceBook
from metering.billing.reports import Report
from metering.models import RequestLogEntry, UsageRecord, UsageRollup
from tenants.limits import key_cap_errors, quota_table
from tenants.models import (
    LIMIT_FIELDS,
    ApiKey,
    Budget,
    Invitation,
    ManagementToken,
    Membership,
    Project,
    Quota,
    Tenant,
)


class TenantSerializer(serializers.ModelSerializer[Tenant]):
    class Meta:
        model = Tenant
        fields = ["id", "name", "slug", "status", "tier", "region", "home_cell", "extra_cells",
                  "content_logging", "end_user_header", "created_at", "updated_at"]
        # Content logging is the tenant's decision, switched by its owner with an audit row
        # (``PUT /api/tenants/<t>/content-logging/set/``), never by platform staff here.
        read_only_fields = ["id", "content_logging", "end_user_header", "created_at", "updated_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if isinstance(self.initial_data, dict) and "content_logging" in self.initial_data:
            raise serializers.ValidationError({"content_logging": [
                "Only the tenant's owner switches content logging, through "
                "/api/tenants/<tenant>/content-logging/set/ (audited)."]})
        # The model's clean() names unknown cells; DRF does not call it by itself.
        probe = Tenant(home_cell=attrs.get("home_cell", getattr(self.instance, "home_cell", "")),
                       extra_cells=attrs.get("extra_cells",
                                             getattr(self.instance, "extra_cells", "")))
        try:
            probe.clean()
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.message_dict) from None
        return attrs


class ApiKeySerializer(serializers.ModelSerializer[ApiKey]):
    allowed_models = serializers.SlugRelatedField(
        many=True, slug_field="name", queryset=ServedModel.objects.all(), required=False
    )
    created_by: serializers.StringRelatedField[User] = serializers.StringRelatedField(
        allow_null=True)  # None: made by a token
    state = serializers.SerializerMethodField(
        help_text="active, over budget (a spend alert's hard cap: 429 insufficient_quota until "
                  "an owner resumes it), expired or revoked.")

    class Meta:
        model = ApiKey
        fields = ["id", "name", "prefix", "last_four", "allowed_models", *LIMIT_FIELDS,
                  "created_by", "created_at", "expires_at", "revoked_at", "last_used_at",
                  "over_budget_at", "state", "project"]
        read_only_fields = ["id", "prefix", "last_four", "created_by", "created_at",
                            "revoked_at", "last_used_at", "over_budget_at"]

    def get_state(self, key: ApiKey) -> str:
        return key.state()

    def get_fields(self) -> dict[str, Any]:
        # Names resolve among the tenant's own models only, so a private model of another
        # tenant answers exactly as an unknown one ("does not exist").
        fields = super().get_fields()
        tenant = self.context.get("tenant")
        if tenant is not None:
            many = fields["allowed_models"]
            assert isinstance(many, serializers.ManyRelatedField)
            # DRF's stubs type ``queryset`` as a manager descriptor; it is a plain attribute.
            relation: Any = many.child_relation
            relation.queryset = models_for(tenant)
        return fields

    def validate_allowed_models(self, value: list[ServedModel]) -> list[ServedModel]:
        usable = set(models_for(self.context["tenant"]))
        if bad := [m.name for m in value if m not in usable]:
            raise serializers.ValidationError(f"Not available to this tenant: {', '.join(bad)}")
        return value

    def validate_project(self, value: Project | None) -> Project | None:
        if value is not None and value.tenant_id != self.context["tenant"].pk:
            raise serializers.ValidationError("No such project in this tenant.")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        caps = {f: attrs[f] for f in LIMIT_FIELDS if attrs.get(f) is not None}
        errors = key_cap_errors(caps, quota_table(self.context["tenant"]))
        if errors:
            raise serializers.ValidationError(errors)
        return attrs


class NewApiKeySerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The key itself. Shown only once.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


class RotateSerializer(serializers.Serializer[dict[str, Any]]):
    grace_seconds = serializers.IntegerField(min_value=0, max_value=90 * 86400, default=86400)


class MembershipSerializer(serializers.ModelSerializer[Membership]):
    user = serializers.CharField(source="user.username", read_only=True)
    email = serializers.EmailField(source="user.email", read_only=True)

    class Meta:
        model = Membership
        fields = ["id", "user", "email", "role", "created_at"]
        read_only_fields = ["id", "created_at"]


class InvitationSerializer(serializers.ModelSerializer[Invitation]):
    """An invitation. Creating one emails its link; the answer is the same whether or not the
    address belongs to an account."""

    invited_by: serializers.StringRelatedField[User] = serializers.StringRelatedField(
        allow_null=True)

    class Meta:
        model = Invitation
        fields = ["id", "email", "role", "invited_by", "created_at", "expires_at"]
        read_only_fields = ["id", "invited_by", "created_at", "expires_at"]


class ManagementTokenSerializer(serializers.ModelSerializer[ManagementToken]):
    created_by: serializers.StringRelatedField[User] = serializers.StringRelatedField(
        allow_null=True)
    active = serializers.SerializerMethodField(
        help_text="Usable now: not revoked, not expired, and its maker still an owner.")

    class Meta:
        model = ManagementToken
        fields = ["id", "name", "prefix", "last_four", "role", "created_by", "created_at",
                  "expires_at", "last_used_at", "revoked_at", "active"]
        read_only_fields = fields

    def get_active(self, token: ManagementToken) -> bool:
        return token.pk in self.context.get("usable", ())


class QuotaSerializer(serializers.ModelSerializer[Quota]):
    model = serializers.SlugRelatedField(
        slug_field="name", queryset=ServedModel.objects.all(), allow_null=True, required=False
    )

    class Meta:
        model = Quota
        exclude = ["tenant"]


class UsageRecordSerializer(serializers.ModelSerializer[UsageRecord]):
    class Meta:
        model = UsageRecord
        fields = ["request_id", "api_key", "model_name", "pool_name", "prompt_tokens",
                  "cached_tokens", "completion_tokens", "queue_wait_ms", "ttft_ms", "total_ms",
                  "status", "finish_reason", "error_code", "stream", "end_user", "started_at",
                  "finished_at"]


class RequestLogEntrySerializer(serializers.ModelSerializer[RequestLogEntry]):
    cost = serializers.SerializerMethodField(help_text="At the model's price when it ended; "
                                             "null for an unpriced model.")
    currency = serializers.SerializerMethodField()

    class Meta:
        model = RequestLogEntry
        fields = ["request_id", "at", "api_key", "project_id", "end_user", "model_name",
                  "pool_name", "http_status", "status", "error_code", "prompt_tokens",
                  "cached_tokens", "completion_tokens", "cost", "currency", "ttft_ms",
                  "total_ms", "stream"]

    def _priced(self, entry: RequestLogEntry) -> tuple[Decimal, str]:
        if entry.status == "refused":  # never admitted, so never charged
            return Decimal(0), "-"
        prices: PriceBook = self.context["prices"]
        return prices.cost(entry.model_name, entry.at, entry.prompt_tokens,
                                           entry.cached_tokens, entry.completion_tokens)

    @extend_schema_field(serializers.DecimalField(max_digits=20, decimal_places=10,
                                                  allow_null=True))
    def get_cost(self, entry: RequestLogEntry) -> str | None:
        cost, currency = self._priced(entry)
        return str(cost) if currency else None

    def get_currency(self, entry: RequestLogEntry) -> str:
        return self._priced(entry)[1].strip("-")


class UsageRollupSerializer(serializers.ModelSerializer[UsageRollup]):
    class Meta:
        model = UsageRollup
        fields = ["hour", "api_key", "model_name", "end_user", "requests", "errors",
                  "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms_sum",
                  "total_ms_sum"]


class ReportRowSerializer(serializers.Serializer[dict[str, Any]]):
    tenant = serializers.CharField()
    project = serializers.CharField()
    key = serializers.CharField()
    model = serializers.CharField()
    end_user = serializers.CharField()
    currency = serializers.CharField()
    requests = serializers.IntegerField()
    input_tokens = serializers.IntegerField()
    cached_input_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    cost = serializers.DecimalField(max_digits=30, decimal_places=12, coerce_to_string=True)
    # Rounded to the currency's minor unit (metering.billing.money); null = unpriced usage.
    amount = serializers.DecimalField(max_digits=30, decimal_places=6, coerce_to_string=True,
                                      allow_null=True)
    priced = serializers.BooleanField()


class ReportSerializer(serializers.Serializer[Report]):
    start = serializers.DateTimeField()
    end = serializers.DateTimeField()
    group_by = serializers.ListField(child=serializers.CharField())
    rows = ReportRowSerializer(many=True)
    totals = ReportRowSerializer(many=True)


class ExportJobSerializer(serializers.ModelSerializer[ExportJob]):
    progress = serializers.IntegerField(read_only=True)

    class Meta:
        model = ExportJob
        fields = ["id", "start", "end", "group_by", "format", "status", "progress", "rows_done",
                  "rows_total", "error", "created_at", "finished_at"]
        read_only_fields = ["id", "status", "progress", "rows_done", "rows_total", "error",
                            "created_at", "finished_at"]


class SpendAlertSerializer(serializers.ModelSerializer[SpendAlert]):
    webhook_secret = serializers.SerializerMethodField(
        help_text="Signs deliveries (X-Gateway-Signature). Returned once, in the answer that "
        "set the first webhook URL; null ever after.")

    class Meta:
        model = SpendAlert
        fields = ["id", "api_key", "metric", "period", "threshold", "currency", "webhook_url",
                  "webhook_secret", "hard_cap", "enabled", "last_fired_period", "created_at"]
        read_only_fields = ["id", "last_fired_period", "created_at"]

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_webhook_secret(self, instance: SpendAlert) -> str | None:
        return instance.webhook_secret if getattr(instance, "secret_is_new", False) else None

    def validate_api_key(self, value: ApiKey | None) -> ApiKey | None:
        if value is not None and value.tenant_id != self.context["tenant"].pk:
            raise serializers.ValidationError("No such key in this tenant.")
        return value


class ProjectSerializer(serializers.ModelSerializer[Project]):
    allowed_models = serializers.SlugRelatedField(
        many=True, slug_field="name", queryset=ServedModel.objects.all(), required=False)

    class Meta:
        model = Project
        fields = ["id", "name", "slug", "allowed_models", "created_at"]
        read_only_fields = ["id", "created_at"]

    def validate_slug(self, value: str) -> str:
        taken = Project.objects.filter(tenant=self.context["tenant"], slug=value)
        if self.instance is not None:
            taken = taken.exclude(pk=self.instance.pk)
        if taken.exists():
            raise serializers.ValidationError("This tenant already has a project so named.")
        return value

    def validate_allowed_models(self, value: list[ServedModel]) -> list[ServedModel]:
        usable = set(models_for(self.context["tenant"]))
        if bad := [m.name for m in value if m not in usable]:
            raise serializers.ValidationError(f"Not available to this tenant: {', '.join(bad)}")
        return value


class BudgetSerializer(serializers.ModelSerializer[Budget]):
    """A budget and, read-only, where it stands now (``metering.billing.budget_status``)."""

    spent = serializers.SerializerMethodField(help_text="This period so far (money or tokens).")
    percent = serializers.SerializerMethodField()
    resets_at = serializers.SerializerMethodField(help_text="UTC; null for a lifetime budget.")
    projected = serializers.SerializerMethodField(
        help_text="Spend at the end of the period if it goes on at this rate.")

    class Meta:
        model = Budget
        fields = ["id", "level", "project", "api_key", "end_user", "metric", "limit", "currency",
                  "period", "enabled", "spent", "percent", "resets_at", "projected",
                  "created_at"]
        read_only_fields = ["id", "created_at"]

    def _status(self, budget: Budget) -> Any:
        cache: dict[int, Any] = self.__dict__.setdefault("_budget_status", {})
        if budget.pk not in cache:
            cache[budget.pk] = status_of(budget, timezone.now())
        return cache[budget.pk]

    @extend_schema_field(serializers.DecimalField(max_digits=24, decimal_places=6))
    def get_spent(self, budget: Budget) -> str:
        return f"{self._status(budget).spent:f}"

    @extend_schema_field(serializers.FloatField())
    def get_percent(self, budget: Budget) -> float:
        return float(self._status(budget).percent)

    @extend_schema_field(serializers.DateTimeField(allow_null=True))
    def get_resets_at(self, budget: Budget) -> str | None:
        when = self._status(budget).resets_at
        return when.isoformat() if when else None

    @extend_schema_field(serializers.DecimalField(max_digits=24, decimal_places=6,
                                                  allow_null=True))
    def get_projected(self, budget: Budget) -> str | None:
        value = self._status(budget).projected
        return None if value is None else f"{value.quantize(Decimal('0.000001')):f}"

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        tenant = self.context["tenant"]
        merged = {**({f: getattr(self.instance, f) for f in self.Meta.fields
                      if hasattr(Budget, f) and f not in self.Meta.read_only_fields}
                     if self.instance else {}), **attrs}
        candidate = Budget(tenant=tenant, **{k: v for k, v in merged.items()
                                             if k in {f.name for f in Budget._meta.fields}})
        if self.instance is not None:  # an update is checked against the others, not itself
            candidate.pk, candidate._state.adding = self.instance.pk, False
        try:
            candidate.clean()
            candidate.validate_constraints()
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.message_dict) from None
        return attrs


class AlertEventSerializer(serializers.ModelSerializer[AlertEvent]):
    class Meta:
        model = AlertEvent
        fields = ["id", "alert", "period", "value", "emailed", "webhook_status", "suspended",
                  "fired_at"]


class ServedModelSerializer(serializers.ModelSerializer[ServedModel]):
    class Meta:
        model = ServedModel
        fields = ["id", "name", "engine_model_id", "tokenizer_path", "max_model_len",
                  "tool_call_parser", "task", "num_layers", "num_kv_heads", "head_dim",
                  "bytes_per_value", "parameter_count", "created_at"]
        read_only_fields = ["id", "created_at"]


class PublicModelSerializer(serializers.ModelSerializer[ServedModel]):
    """What a tenant needs to call a model; engine ids and tokenizer paths stay with staff."""

    class Meta:
        model = ServedModel
        fields = ["name", "max_model_len", "created_at"]
        read_only_fields = fields


class PoolSerializer(serializers.ModelSerializer[Pool]):
    model = serializers.SlugRelatedField(slug_field="name", queryset=ServedModel.objects.all())
    dedicated_to = serializers.SlugRelatedField(
        slug_field="slug", queryset=Tenant.objects.all(), allow_null=True, required=False
    )

    class Meta:
        model = Pool
        fields = ["id", "name", "model", "region", "cell", "backend", "backend_settings",
                  "max_sequences", "kv_cache_tokens", "kv_overcommit", "dedicated_to", "enabled",
                  "created_at"]
        read_only_fields = ["id", "created_at"]


class PublicPoolSerializer(serializers.ModelSerializer[Pool]):
    """A pool as a tenant sees it: no backend settings (they may hold upstream credentials)."""

    model: serializers.SlugRelatedField[ServedModel] = serializers.SlugRelatedField(
        slug_field="name", read_only=True)

    class Meta:
        model = Pool
        fields = ["name", "model", "region", "enabled"]
        read_only_fields = fields


class PriceSerializer(serializers.ModelSerializer[Price]):
    class Meta:
        model = Price
        fields = ["id", "model_name", "currency", "input_per_mtok", "cached_input_per_mtok",
                  "output_per_mtok", "effective_from"]


class ContentLoggingChangeSerializer(serializers.Serializer[dict[str, Any]]):
    enabled = serializers.BooleanField()
    # None when a management token (no user) made the change.
    changed_by: serializers.StringRelatedField[User] = serializers.StringRelatedField(
        allow_null=True)
    changed_at = serializers.DateTimeField()


class ContentLoggingSerializer(serializers.Serializer[dict[str, Any]]):
    enabled = serializers.BooleanField(help_text="Store prompts and responses (encrypted).")
    retention_days = serializers.IntegerField(read_only=True, allow_null=True)
    changes = ContentLoggingChangeSerializer(many=True, read_only=True)


class ResponseCacheSerializer(serializers.Serializer[dict[str, Any]]):
    enabled = serializers.BooleanField(
        help_text="Answer a repeated deterministic request (temperature 0 or a seed) from this "
                  "tenant's own exact-match cache; the cached answers are stored content.")
    changes = ContentLoggingChangeSerializer(many=True, read_only=True)
