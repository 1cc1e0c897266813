"""Switching a tenant's content logging, with its audit row: the one path the portal and the
management API both take."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import QuerySet

from tenants.auth import invalidate_principals
from tenants.models import ContentLoggingChange, Tenant


def switch_content_logging(tenant: Tenant, enabled: bool, user: Any,
                           remote_addr: str | None = None) -> bool:
    """Set the flag; True if it changed. The flag and its audit row commit together, and only a
    real change is recorded (one conditional UPDATE decides, so two clicks record once)."""
    with transaction.atomic():
        changed = Tenant.objects.filter(pk=tenant.pk).exclude(content_logging=enabled).update(
            content_logging=enabled
        )
        if changed:
            actor = user if getattr(user, "pk", None) else None  # a token may have no creator
            ContentLoggingChange.objects.create(
                tenant=tenant, enabled=enabled, changed_by=actor, remote_addr=remote_addr
            )
    if changed:
        # update() sends no signal; every gateway must see the new flag on its next request.
        invalidate_principals()
    tenant.content_logging = enabled
    return bool(changed)


def content_logging_changes(tenant: Tenant) -> QuerySet[ContentLoggingChange]:
    """The tenant's audit trail, newest first, with who switched (one query)."""
    return ContentLoggingChange.objects.filter(tenant=tenant).select_related("changed_by")
