"""Tell every gateway process when something a Principal is built from changes.

A Principal holds the key, its tenant (status, tier weight, region), the key's allowed models
and the tenant's quotas. A save or delete of any of them rewrites the auth epoch
(``tenants.auth.invalidate_principals``) so cached principals are reloaded on the next request.
Bulk ``QuerySet.update`` sends no signal: code that revokes in bulk goes through
``ApiKeyQuerySet.revoke``, which sends ``keys_revoked``.

Also: when someone stops being an owner of a tenant (role changed, membership deleted, account
deactivated), the management tokens they made there are revoked, so the tokens page says so.
Authentication does not rely on this: ``ManagementToken.objects.usable`` checks the maker on
every use, which also covers bulk updates that send no signal.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db.models.signals import m2m_changed, post_delete, post_save
from django.dispatch import receiver
from django.utils import timezone

from catalog.models import ServedModel
from tenants.auth import invalidate_principals
from tenants.management_tokens import revoke_made_by
from tenants.models import (
    ApiKey,
    Budget,
    ClientCertificate,
    IdentityProvider,
    ManagementToken,
    Membership,
    Project,
    Quota,
    Tenant,
    Tier,
    keys_revoked,
)


def _changed(sender: type, instance: Any, created: bool = False, **kwargs: Any) -> None:
    if created and sender in (ApiKey, Tenant, ServedModel, Tier):
        return  # nothing cached can refer to a row that did not exist
    invalidate_principals()


for model in (Tier, Tenant, Quota, ApiKey, ServedModel, IdentityProvider, ClientCertificate,
              Project, Budget):
    post_save.connect(_changed, sender=model, dispatch_uid=f"auth-epoch-save-{model.__name__}")
    post_delete.connect(_changed, sender=model, dispatch_uid=f"auth-epoch-del-{model.__name__}")


@receiver(m2m_changed, sender=ApiKey.allowed_models.through, dispatch_uid="auth-epoch-m2m")
@receiver(m2m_changed, sender=Project.allowed_models.through,
          dispatch_uid="auth-epoch-project-m2m")
def _allowed_models_changed(action: str, **kwargs: Any) -> None:
    if action.startswith("post_"):
        invalidate_principals()


@receiver(keys_revoked, dispatch_uid="auth-epoch-revoke")
def _revoked(**_: Any) -> None:
    invalidate_principals()


@receiver(post_save, sender=Membership, dispatch_uid="tokens-end-with-owner-role")
def _role_changed(instance: Membership, **kwargs: Any) -> None:
    if instance.role != Membership.Role.OWNER:
        revoke_made_by(instance.user_id, instance.tenant_id)


@receiver(post_delete, sender=Membership, dispatch_uid="tokens-end-with-membership")
def _membership_deleted(instance: Membership, **kwargs: Any) -> None:
    revoke_made_by(instance.user_id, instance.tenant_id)


@receiver(post_save, sender=settings.AUTH_USER_MODEL, dispatch_uid="tokens-end-with-account")
def _account_changed(instance: Any, **kwargs: Any) -> None:
    if not instance.is_active:
        ManagementToken.objects.filter(created_by_id=instance.pk, revoked_at__isnull=True) \
            .update(revoked_at=timezone.now())
