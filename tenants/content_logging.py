"""Switching a tenant's content-storing opt-ins, with their audit rows, for the portal and the API.

Two flags store what a tenant's users send or receive: content logging (prompts and responses,
encrypted) and the response cache (answers kept to serve a repeated request). Both are the
tenant owner's decision, audited the same way; platform staff never switch them (review 3, N9).
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from tenants.auth import invalidate_principals
from tenants.models import ContentLoggingChange, Tenant

Setting = ContentLoggingChange.Setting


def switch(tenant: Tenant, enabled: bool, user: Any, remote_addr: str | None = None,
           setting: str = Setting.CONTENT_LOGGING) -> bool:
    """Set the flag; True if it changed. The flag and its audit row commit together, and only a
    real change is recorded (one conditional UPDATE decides, so two clicks record once)."""
    field = Setting(setting).value
    with transaction.atomic():
        changed = Tenant.objects.filter(pk=tenant.pk).exclude(**{field: enabled}).update(
            **{field: enabled})
        if changed:
            actor = user if getattr(user, "pk", None) else None  # a token may have no creator
            ContentLoggingChange.objects.create(
                tenant=tenant, setting=field, enabled=enabled, changed_by=actor,
                remote_addr=remote_addr)
    if changed:
        # update() sends no signal; every gateway must see the new flag on its next request.
        invalidate_principals()
    setattr(tenant, field, enabled)
    return bool(changed)
