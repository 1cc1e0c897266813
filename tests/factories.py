"""Small factories for tenancy objects, so tests read as sentences."""

from __future__ import annotations

import itertools
from typing import Any

from catalog.models import Pool, ServedModel
from tenants.models import Quota, Tenant, Tier

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


UNLIMITED = 10**9  # tokens per minute and burst that no test reaches


def open_quota(*, streams: int = 100, ttft_s: float = 20.0, total_s: float = 30.0,
               **extra: Any) -> dict[str, Any]:
    """A quota that never throttles by tokens (fault tests measure recovery, not limits):
    ``streams`` concurrent requests and open streams, and the two deadlines."""
    return {"input_tpm": UNLIMITED, "input_burst": UNLIMITED, "output_tpm": UNLIMITED,
            "output_burst": UNLIMITED, "concurrent_requests": streams, "open_streams": streams,
            "max_output_tokens": 4000, "ttft_deadline_s": ttft_s, "total_deadline_s": total_s,
            **extra}


def make_key(tenant: Tenant | None = None, name: str = "test key", **fields):
    """Issue a key through the real service; returns (ApiKey, plaintext)."""
    from tenants.api_keys import issue_key

    return issue_key(tenant or make_tenant(), name, **fields)


def bearer(plaintext: str) -> str:
    return f"Bearer {plaintext}"
