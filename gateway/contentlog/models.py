"""The content log: encrypted prompts and responses of opted-in tenants, and who read them.

Kept apart from metering on purpose: no foreign key to usage records and no shared table, so
no query joins what a tenant sent with what it was billed. ``request_id`` is the only link, and
reading content needs a break-glass grant (``gateway.contentlog.breakglass``).
"""

from __future__ import annotations

import uuid
from typing import Any, NoReturn

from django.conf import settings
from django.db import models

from tenants.models import Tenant


class TenantKey(models.Model):
    """One version of a tenant's data-encryption key, stored only wrapped by a master key.

    Deleting the row (tenant deletion cascades here) is crypto-shredding: every record sealed
    under that version becomes unreadable, wherever copies of the records live.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    version = models.PositiveIntegerField()
    master_kid = models.CharField(max_length=64, help_text="Master key that wraps this DEK.")
    wrapped_dek = models.BinaryField(editable=False)
    active = models.BooleanField(default=True, help_text="New records are sealed under it.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "version"], name="one_dek_per_version"),
            models.UniqueConstraint(
                fields=["tenant"], condition=models.Q(active=True), name="one_active_dek"
            ),
        ]

    def __str__(self) -> str:
        return f"tenant {self.tenant_id} DEK v{self.version} (wrapped by {self.master_kid})"


class ContentRecordQuerySet(models.QuerySet["ContentRecord"]):
    def for_tenant(self, tenant: Tenant | int) -> ContentRecordQuerySet:
        return self.filter(tenant_id=getattr(tenant, "pk", tenant))

    def expired(self, now: Any) -> ContentRecordQuerySet:
        return self.filter(expires_at__lte=now)


class ContentRecord(models.Model):
    """One request's prompt and response, sealed under the tenant's DEK (AES-256-GCM).

    The id is chosen before sealing because it is part of the associated data.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    request_id = models.CharField(max_length=64)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    key_version = models.PositiveIntegerField()
    ciphertext = models.BinaryField(editable=False)

    objects = ContentRecordQuerySet.as_manager()

    class Meta:
        constraints = [
            # Makes re-inserting a batch after a crash a no-op (the drain is at-least-once).
            models.UniqueConstraint(fields=["tenant", "request_id"], name="one_record_per_req"),
        ]
        indexes = [
            models.Index(fields=["expires_at"], name="contentlog_expires_idx"),
            models.Index(fields=["tenant", "created_at"], name="contentlog_tenant_created_idx"),
        ]

    def __str__(self) -> str:
        return f"content of {self.request_id} (tenant {self.tenant_id})"


class BreakGlassGrant(models.Model):
    """A staff member's time-boxed, approved access to one tenant's records in one time window."""

    class State(models.TextChoices):
        PENDING = "pending", "Waiting for approval"
        APPROVED = "approved", "Approved"
        DENIED = "denied", "Denied"
        REVOKED = "revoked", "Revoked"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+"
    )
    justification = models.TextField()
    records_from = models.DateTimeField(help_text="Only records created in this window.")
    records_until = models.DateTimeField()
    duration_minutes = models.PositiveIntegerField(help_text="Minutes of access from approval.")
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    approved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
        related_name="+",
    )
    self_approved = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    access_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        permissions = [
            ("request_breakglass", "Can request break-glass access to tenant content"),
            ("approve_breakglass", "Can approve another staff member's break-glass request"),
        ]

    def __str__(self) -> str:
        return f"grant {self.pk} on tenant {self.tenant_id} ({self.state})"


class AppendOnlyQuerySet(models.QuerySet["AuditEntry"]):
    def update(self, **kwargs: Any) -> NoReturn:
        raise PermissionError("the break-glass audit log is append-only")

    def delete(self) -> NoReturn:
        raise PermissionError("the break-glass audit log is append-only")


class AuditEntry(models.Model):
    """Append-only: who read or decided what, when and why. Never updated, never deleted.

    The tenant and record are plain ids (no cascading FK) so entries outlive the tenant's
    records, keys and even the tenant: the log of who looked must survive the data.
    """

    class Action(models.TextChoices):
        REQUESTED = "requested", "Access requested"
        APPROVED = "approved", "Access approved"
        SELF_APPROVED = "self_approved", "Access self-approved"
        DENIED = "denied", "Access denied"
        REVOKED = "revoked", "Access revoked"
        DECRYPTED = "decrypted", "Record decrypted"
        SHREDDED = "shredded", "Content log shredded"

    tenant_id = models.BigIntegerField(db_index=True)
    grant_id = models.BigIntegerField(null=True, blank=True)
    action = models.CharField(max_length=16, choices=Action.choices)
    actor_id = models.BigIntegerField(null=True, blank=True)
    actor_username = models.CharField(max_length=150)
    record_id = models.UUIDField(null=True, blank=True)
    request_id = models.CharField(max_length=64, blank=True)
    justification = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    objects = AppendOnlyQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M} {self.actor_username} {self.action}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        pk: int | None = self.pk  # None until saved, though the stubs type it int
        if pk is not None or kwargs.get("force_update"):
            raise PermissionError("the break-glass audit log is append-only")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise PermissionError("the break-glass audit log is append-only")
