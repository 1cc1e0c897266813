"""Switching a tenant's content logging, with its audit row, for the portal and the API."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from gateway.portal.models import ContentLoggingChange
from tenants.models import Tenant


def switch(tenant: Tenant, enabled: bool, user: Any, remote_addr: str | None = None) -> bool:
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
        from tenants.auth import invalidate_principals

        invalidate_principals()
    tenant.content_logging = enabled
    return bool(changed)
