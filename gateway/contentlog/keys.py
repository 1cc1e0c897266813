"""Tenant data keys: create, load, rotate, re-wrap, shred.

Invariant: a tenant has at most one active DEK version (a partial unique index enforces it);
records name the version that sealed them, so rotating the DEK never strands a record.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.db.models import Max

from gateway.contentlog import crypto
from gateway.contentlog.models import TenantKey


def active_key(tenant_id: int) -> tuple[int, bytes]:
    """The tenant's active (version, DEK), creating the first one if there is none."""
    row = TenantKey.objects.filter(tenant_id=tenant_id, active=True).first()
    if row is None:
        row = _create(tenant_id)
    return row.version, crypto.unwrap_dek(row.master_kid, row.wrapped_dek, tenant_id, row.version)


def dek_for(tenant_id: int, version: int) -> bytes:
    """The DEK that sealed a record; DecryptionError once it has been shredded."""
    row = TenantKey.objects.filter(tenant_id=tenant_id, version=version).first()
    if row is None:
        raise crypto.DecryptionError(f"tenant {tenant_id} DEK v{version} no longer exists")
    return crypto.unwrap_dek(row.master_kid, row.wrapped_dek, tenant_id, version)


def _create(tenant_id: int) -> TenantKey:
    # Two drains may race to create the first key: the unique index picks one, the other reads it.
    try:
        with transaction.atomic():
            return _insert_version(tenant_id, 1)
    except IntegrityError:
        return TenantKey.objects.get(tenant_id=tenant_id, active=True)


def _insert_version(tenant_id: int, version: int) -> TenantKey:
    kid, wrapped = crypto.wrap_dek(crypto.new_dek(), tenant_id, version)
    return TenantKey.objects.create(
        tenant_id=tenant_id, version=version, master_kid=kid, wrapped_dek=wrapped
    )


def new_version(tenant_id: int) -> int:
    """Retire the active DEK and create the next version; returns the new version."""
    with transaction.atomic():
        current = TenantKey.objects.select_for_update().filter(tenant_id=tenant_id)
        latest = current.aggregate(v=Max("version"))["v"] or 0
        current.filter(active=True).update(active=False)
        return _insert_version(tenant_id, latest + 1).version


def rewrap_all(batch: int = 500) -> int:
    """Re-wrap every DEK not wrapped by the newest master key. Records are not touched.

    Each row is unwrapped with the key it names and wrapped again under the newest one, in a
    conditional UPDATE, so two concurrent runs never lose a row.
    """
    newest = crypto.current_master().kid
    done = 0
    while True:
        rows = list(TenantKey.objects.exclude(master_kid=newest)[:batch])
        if not rows:
            return done
        for row in rows:
            dek = crypto.unwrap_dek(row.master_kid, row.wrapped_dek, row.tenant_id, row.version)
            kid, wrapped = crypto.wrap_dek(dek, row.tenant_id, row.version)
            done += TenantKey.objects.filter(pk=row.pk, master_kid=row.master_kid).update(
                master_kid=kid, wrapped_dek=wrapped
            )


def destroy_keys(tenant_id: int) -> int:
    """Crypto-shred: delete every DEK version of the tenant."""
    return TenantKey.objects.filter(tenant_id=tenant_id).delete()[0]
