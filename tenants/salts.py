"""Prefix-cache salts: tenants share KV-cache blocks only within one salt (I1).

Engines reuse cached KV blocks for identical prefixes. If two tenants shared a cache, the time to
first token would reveal whether the other tenant recently sent the same prefix, so every request
carries its tenant's salt and blocks are matched only within it. The salt is an HMAC of the
tenant id under a server secret: stable across processes and restarts, unguessable from outside.
Prefixes the platform itself supplies (a shared system prompt) may use ``platform_salt`` instead.
"""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings


def _salt(label: str) -> str:
    secret = settings.CACHE_SALT_SECRET.encode()
    return hmac.new(secret, label.encode(), hashlib.sha256).hexdigest()


def cache_salt(tenant_id: int) -> str:
    return _salt(f"tenant:{int(tenant_id)}")


def platform_salt() -> str:
    """The one salt for platform-supplied prefixes; it can never equal a tenant's salt."""
    return _salt("platform")
