"""What the portal itself stores: the content-logging audit trail and management tokens."""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db import models
from django.utils import timezone

from tenants.models import Membership, Tenant


class ContentLoggingChange(models.Model):
    """Who switched a tenant's content logging on or off, and when. Rows are never edited."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    enabled = models.BooleanField()
    changed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    changed_at = models.DateTimeField(auto_now_add=True)
    remote_addr = models.GenericIPAddressField(null=True, blank=True)

    class Meta:
        ordering = ["-changed_at", "-id"]

    def __str__(self) -> str:
        state = "on" if self.enabled else "off"
        return f"{self.tenant} content logging {state} by {self.changed_by} at {self.changed_at}"


class ManagementTokenQuerySet(models.QuerySet["ManagementToken"]):
    def usable(self, now: datetime | None = None) -> ManagementTokenQuerySet:
        now = now or timezone.now()
        return self.filter(revoked_at__isnull=True).filter(
            models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=now)
        )


class ManagementToken(models.Model):
    """A credential for the management API, bound to one tenant and acting with one role.

    Stored like API keys: only an HMAC under a versioned pepper (``gateway.portal.tokens``).
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    name = models.CharField(max_length=100)
    role = models.CharField(
        max_length=16, choices=Membership.Role.choices, default=Membership.Role.BILLING
    )
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    pepper_version = models.PositiveSmallIntegerField(editable=False)
    prefix = models.CharField(max_length=24, editable=False)
    last_four = models.CharField(max_length=4, editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    objects = ManagementTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.masked})"

    @property
    def masked(self) -> str:
        return f"{self.prefix}…{self.last_four}"
