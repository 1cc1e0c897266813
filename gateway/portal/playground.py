"""The playground's key: one short-lived key per user and tenant, reused until it nears expiry.

The browser needs a real key to call ``/v1`` as the tenant's applications do. Minting a
permanent key per click would litter the key list (and leave live secrets behind), so:

- the key expires after ``PLAYGROUND_KEY_TTL`` and is named for the user who made it;
- its plaintext lives only in that user's server-side session, next to its id, and is handed
  back while the key still has ``REUSE_MARGIN`` to live;
- minting a new one revokes the user's older playground keys in the tenant, so at most one
  is live per user and tenant (two tabs racing may briefly both mint; the later one wins and
  the earlier is revoked at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from tenants.api_keys import issue_key
from tenants.membership import PLAYGROUND_PREFIX as PLAYGROUND_PREFIX
from tenants.models import ApiKey, Tenant

PLAYGROUND_KEY_TTL = timedelta(minutes=30)
REUSE_MARGIN = timedelta(minutes=2)
SESSION_KEY = "portal_playground_key"
# Key forms refuse names starting with it; removing a member revokes their playground key.


@dataclass
class PlaygroundKey:
    key: ApiKey
    plaintext: str
    reused: bool


def key_name(user: Any) -> str:
    return f"{PLAYGROUND_PREFIX} {user.get_username()}"


def is_playground_key(key: ApiKey) -> bool:
    return key.created_by is not None and key.name == key_name(key.created_by)


def playground_key(session: Any, tenant: Tenant, user: Any,
                   now: datetime | None = None) -> PlaygroundKey:
    now = now or timezone.now()
    parked = session.get(SESSION_KEY) or {}
    key_id: int | None = parked.get("key_id")
    if parked.get("tenant_id") == tenant.pk and key_id is not None:
        key = ApiKey.objects.filter(pk=key_id, tenant=tenant, created_by=user,
                                    name=key_name(user)).usable(now + REUSE_MARGIN).first()
        if key is not None:
            return PlaygroundKey(key, parked["plaintext"], reused=True)
    ApiKey.objects.filter(tenant=tenant, created_by=user, name=key_name(user)).revoke()
    key, plaintext = issue_key(tenant, key_name(user), created_by=user,
                               expires_at=now + PLAYGROUND_KEY_TTL)
    session[SESSION_KEY] = {"tenant_id": tenant.pk, "key_id": key.pk, "plaintext": plaintext}
    return PlaygroundKey(key, plaintext, reused=False)
