"""Tell every gateway process when something a Principal is built from changes.

A Principal holds the key, its tenant (status, tier weight, region), the key's allowed models
and the tenant's quotas. A save or delete of any of them rewrites the auth epoch
(``tenants.auth.invalidate_principals``) so cached principals are reloaded on the next request.
Bulk ``QuerySet.update`` sends no signal: code that revokes in bulk goes through
``ApiKeyQuerySet.revoke``, which sends ``keys_revoked``.
"""

from __future__ import annotations

from typing import Any

from django.db.models.signals import m2m_changed, post_delete, post_save
from django.dispatch import receiver

from tenants.auth import invalidate_principals
from tenants.models import (
    ApiKey,
    ClientCertificate,
    IdentityProvider,
    Quota,
    ServedModel,
    Tenant,
    Tier,
    keys_revoked,
)


def _changed(sender: type, instance: Any, created: bool = False, **kwargs: Any) -> None:
    if created and sender in (ApiKey, Tenant, ServedModel, Tier):
        return  # nothing cached can refer to a row that did not exist
    invalidate_principals()


for model in (Tier, Tenant, Quota, ApiKey, ServedModel, IdentityProvider, ClientCertificate):
    post_save.connect(_changed, sender=model, dispatch_uid=f"auth-epoch-save-{model.__name__}")
    post_delete.connect(_changed, sender=model, dispatch_uid=f"auth-epoch-del-{model.__name__}")


@receiver(m2m_changed, sender=ApiKey.allowed_models.through, dispatch_uid="auth-epoch-m2m")
def _allowed_models_changed(action: str, **kwargs: Any) -> None:
    if action.startswith("post_"):
        invalidate_principals()


@receiver(keys_revoked, dispatch_uid="auth-epoch-revoke")
def _revoked(**_: Any) -> None:
    invalidate_principals()
