"""Retention, crypto-shredding and tenant-key re-encryption.

Retention: each record carries ``expires_at`` (created + the tenant's retention days at write
time); ``purge_expired`` deletes expired rows in batches of primary keys, so one run never holds
a long lock on the table. Shortening a tenant's retention pulls existing records' expiry in.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.db.models.functions import Least
from django.utils import timezone

from gateway.contentlog import crypto, keys
from gateway.contentlog.models import AuditEntry, ContentRecord, TenantKey
from tenants.models import Tenant

PURGE_BATCH = 1000


def purge_expired(now: datetime | None = None, batch: int = PURGE_BATCH,
                  budget_s: float = 120.0) -> int:
    """Delete records whose expiry has passed, for at most ``budget_s``; returns how many.

    The time budget keeps one run inside the Celery soft time limit; what is left is picked up
    by the next run.
    """
    now = now or timezone.now()
    deleted = 0
    stop_at = time.monotonic() + budget_s
    while time.monotonic() < stop_at:
        ids = list(ContentRecord.objects.expired(now).values_list("pk", flat=True)[:batch])
        if not ids:
            break
        deleted += ContentRecord.objects.filter(pk__in=ids).delete()[0]
    return deleted


def set_retention_days(tenant: Tenant, days: int) -> None:
    """Change a tenant's retention (1..CONTENT_LOG_MAX_RETENTION_DAYS); shorter applies at once."""
    if not 1 <= days <= settings.CONTENT_LOG_MAX_RETENTION_DAYS:
        raise ValueError(f"retention must be 1-{settings.CONTENT_LOG_MAX_RETENTION_DAYS} days")
    with transaction.atomic():
        Tenant.objects.filter(pk=tenant.pk).update(content_retention_days=days)
        ContentRecord.objects.for_tenant(tenant).update(
            expires_at=Least(F("expires_at"), F("created_at") + timedelta(days=days))
        )
    tenant.content_retention_days = days


def shred_tenant_content(tenant: Tenant | int, actor: str = "system") -> tuple[int, int]:
    """Destroy the tenant's DEKs (crypto-shredding), then delete its records.

    The keys go first and in their own statement: once they are gone every copy of the records
    (replicas, backups of the records table) is ciphertext nobody can open. Returns (keys,
    records) deleted. Tenant deletion does the same through the FK cascade.
    """
    tenant_id = tenant.pk if isinstance(tenant, Tenant) else tenant
    with transaction.atomic():
        destroyed = keys.destroy_keys(tenant_id)
        records = ContentRecord.objects.for_tenant(tenant_id).delete()[0]
        AuditEntry.objects.create(
            tenant_id=tenant_id, action=AuditEntry.Action.SHREDDED, actor_username=actor,
            justification=f"{destroyed} data keys destroyed, {records} records deleted",
        )
    return destroyed, records


def reencrypt_tenant(tenant: Tenant | int, batch: int = 500) -> int:
    """Seal every record of the tenant under a new DEK version, then destroy the old versions.

    Each record is opened with the version it names and sealed again with a fresh nonce under
    the new version, row by row in conditional UPDATEs (a record already moved is skipped), so
    an interrupted run can simply be run again. Returns the number of records re-sealed.
    """
    tenant_id = tenant.pk if isinstance(tenant, Tenant) else tenant
    version = keys.new_version(tenant_id)
    new_dek = keys.dek_for(tenant_id, version)
    old: dict[int, bytes] = {}
    moved = 0
    while True:
        rows = list(ContentRecord.objects.for_tenant(tenant_id)
                    .exclude(key_version=version).order_by("pk")[:batch])
        if not rows:
            break
        for row in rows:
            if row.key_version not in old:
                old[row.key_version] = keys.dek_for(tenant_id, row.key_version)
            plain = crypto.open_record(old[row.key_version], tenant_id, row.id, row.ciphertext)
            moved += ContentRecord.objects.filter(pk=row.pk, key_version=row.key_version).update(
                key_version=version,
                ciphertext=crypto.seal_record(new_dek, tenant_id, row.id, plain),
            )
    # A drain that loaded the old key just before the switch may still have written under it:
    # only versions no record names are destroyed; a rerun moves and destroys the rest.
    in_use = ContentRecord.objects.for_tenant(tenant_id).values("key_version")
    TenantKey.objects.filter(tenant_id=tenant_id, active=False).exclude(
        version__in=in_use).delete()
    return moved
