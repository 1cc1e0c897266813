"""Usage records (one per request) and hourly rollups. Counts and timings only, never content.

The raw table grows with every request; reports read ``UsageRollup`` (one row per hour, tenant,
key, model and end user), so nothing user-facing scans ``UsageRecord``. Tenant and key are
foreign keys without a database constraint: a usage record must be writable even if its tenant
or key was deleted meanwhile (the bill outlives the key),
and the writer must never fail a batch for it.
"""

from __future__ import annotations

from typing import TypeVar

from django.db import models

from tenants.models import ApiKey, Tenant

_M = TypeVar("_M", bound=models.Model)


def _loose_fk(to: type[_M]) -> models.ForeignKey[_M | None, _M | None]:
    return models.ForeignKey(
        to, on_delete=models.DO_NOTHING, db_constraint=False, related_name="+", null=True
    )


class UsageRecord(models.Model):
    class Status(models.TextChoices):
        OK = "ok", "Completed"
        CANCELLED = "cancelled", "Cancelled by the client"
        ERROR = "error", "Failed"
        EXPIRED = "expired", "Settled by the janitor"

    request_id = models.CharField(max_length=64, unique=True)
    tenant = _loose_fk(Tenant)
    api_key = _loose_fk(ApiKey)
    model_name = models.CharField(max_length=128)
    pool_name = models.CharField(max_length=64, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    queue_wait_ms = models.PositiveIntegerField(null=True, blank=True)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    total_ms = models.PositiveIntegerField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.OK)
    finish_reason = models.CharField(max_length=32, blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    stream = models.BooleanField(default=False)
    end_user = models.CharField(
        max_length=256, blank=True, default="",
        help_text="Who the request was for inside the tenant (its safety_identifier or user, "
                  "or the tenant's end-user header): an identifier, never content.")
    started_at = models.DateTimeField(help_text="Admitted (tokens charged).")
    finished_at = models.DateTimeField(help_text="Settled.")
    recorded_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [
            # The rollup job reads one hour of one tenant at a time.
            models.Index(fields=["finished_at"], name="usage_finished_idx"),
            models.Index(fields=["tenant", "finished_at"], name="usage_tenant_finished_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} ({self.model_name})"


class UsageRollup(models.Model):
    hour = models.DateTimeField(help_text="Start of the hour (UTC) of the requests' finish.")
    tenant = _loose_fk(Tenant)
    api_key = _loose_fk(ApiKey)
    model_name = models.CharField(max_length=128)
    # Part of the row's key so reports can group by end user (ADR 0022: one row per end user
    # who made requests that hour, so the table grows with active end users, not with requests).
    end_user = models.CharField(max_length=256, blank=True, default="")
    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0, help_text="Requests that did not end 'ok'.")
    prompt_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    ttft_ms_sum = models.BigIntegerField(default=0)
    total_ms_sum = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["hour", "tenant", "api_key", "model_name", "end_user"],
                name="one_rollup_per_hour_group_user",
            )
        ]
        indexes = [models.Index(fields=["tenant", "hour"], name="rollup_tenant_hour_idx")]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H:00} tenant {self.tenant_id} {self.model_name}"


class RequestLogEntry(models.Model):
    """One request as its tenant sees it in the request log: admitted or refused (429s too).

    Counts, codes and timings only, never content. Written off the request path by the usage
    writer (metering.requestlog), kept ``REQUEST_LOG_RETENTION_DAYS`` then purged; the bill is
    ``UsageRecord``, which this table neither replaces nor feeds.
    """

    request_id = models.CharField(max_length=64, unique=True)
    at = models.DateTimeField(help_text="When the request ended (settled or refused).")
    tenant = _loose_fk(Tenant)
    api_key = _loose_fk(ApiKey)
    # Filled once projects exist (a nullable id, so the later foreign key changes no data).
    project_id = models.BigIntegerField(null=True, blank=True)
    end_user = models.CharField(max_length=256, blank=True,
                                help_text="The request's `user` / `safety_identifier`.")
    model_name = models.CharField(max_length=128)
    pool_name = models.CharField(max_length=64, blank=True)
    http_status = models.PositiveSmallIntegerField(null=True, blank=True)
    status = models.CharField(max_length=16, help_text="ok, cancelled, error, expired or "
                              "refused (never admitted: nothing was charged).")
    error_code = models.CharField(max_length=64, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    ttft_ms = models.PositiveIntegerField(null=True, blank=True)
    total_ms = models.PositiveIntegerField(null=True, blank=True)
    stream = models.BooleanField(default=False)

    class Meta:
        indexes = [
            models.Index(fields=["tenant", "-at"], name="reqlog_tenant_at_idx"),
            models.Index(fields=["at"], name="reqlog_at_idx"),  # the retention purge
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.status} {self.error_code}".strip()
