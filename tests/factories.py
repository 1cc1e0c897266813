"""Small factories for tenancy objects, so tests read as sentences."""

from __future__ import annotations

import itertools

from tenants.models import Pool, Quota, ServedModel, Tenant, Tier

_seq = itertools.count(1)


def make_tier(name: str | None = None, weight: float = 1.0) -> Tier:
    return Tier.objects.create(name=name or f"tier-{next(_seq)}", weight=weight)


def make_model(name: str = "sim-small", **fields) -> ServedModel:
    defaults = {"engine_model_id": name, "max_model_len": 8192}
    defaults.update(fields)
    return ServedModel.objects.get_or_create(name=name, defaults=defaults)[0]


def make_pool(model: ServedModel | None = None, name: str | None = None, **fields) -> Pool:
    return Pool.objects.create(
        name=name or f"pool-{next(_seq)}", model=model or make_model(), **fields
    )


def make_tenant(slug: str | None = None, *, weight: float = 1.0, **quota) -> Tenant:
    slug = slug or f"tenant-{next(_seq)}"
    tenant = Tenant.objects.create(name=slug.title(), slug=slug, tier=make_tier(weight=weight))
    Quota.objects.create(tenant=tenant, **quota)
    return tenant


def make_key(tenant: Tenant | None = None, name: str = "test key", **fields):
    """Issue a key through the real service; returns (ApiKey, plaintext)."""
    from tenants.keys import issue_key

    return issue_key(tenant or make_tenant(), name, **fields)


def bearer(plaintext: str) -> str:
    return f"Bearer {plaintext}"
