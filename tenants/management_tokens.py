"""Management tokens: ``<API_KEY_PREFIX>mgmt_<body>_<checksum>``, hashed like API keys.

The distinct prefix lets a secret scanner (and a human) tell a management token from an
inference key, and a token never parses as an API key, so it cannot call ``/v1/``.
The body, checksum and HMAC come from ``tenants.api_keys``.

A token works only while its maker is an active owner of its tenant (checked by
``ManagementToken.objects.usable()`` on every authentication, so any way the account, the
membership or the role ends, the token ends with it), and until it expires: every token has an
expiry, ``MANAGEMENT_TOKEN_DEFAULT_DAYS`` unless its maker chose a shorter or longer one (at
most ``MANAGEMENT_TOKEN_MAX_DAYS``).
"""

from __future__ import annotations

import hmac
import secrets
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from tenants.api_keys import (
    BODY_LEN,
    CHECKSUM_LEN,
    DISPLAY_BODY_CHARS,
    RANDOM_BYTES,
    base62,
    checksum,
    current_pepper_version,
    hash_key,
)
from tenants.models import ManagementToken, Tenant

LAST_USED_EVERY = timedelta(minutes=1)


def token_prefix() -> str:
    return f"{settings.API_KEY_PREFIX}mgmt"


def default_expiry() -> datetime:
    return timezone.now() + timedelta(days=settings.MANAGEMENT_TOKEN_DEFAULT_DAYS)


def latest_expiry() -> datetime:
    return timezone.now() + timedelta(days=settings.MANAGEMENT_TOKEN_MAX_DAYS)


def issue_token(tenant: Tenant, name: str, role: str, *, created_by: Any,
                expires_at: datetime | None = None) -> tuple[ManagementToken, str]:
    """A new token and its plaintext (shown once). ``created_by`` must be an owner of
    ``tenant`` for the token to work; ``expires_at`` defaults to the default lifetime."""
    expires_at = min(expires_at or default_expiry(), latest_expiry())
    body = base62(int.from_bytes(secrets.token_bytes(RANDOM_BYTES), "big"), BODY_LEN)
    plaintext = f"{token_prefix()}_{body}_{checksum(body)}"
    version = current_pepper_version()
    token = ManagementToken.objects.create(
        tenant=tenant, name=name, role=role, created_by=created_by, expires_at=expires_at,
        key_hash=hash_key(plaintext, version), pepper_version=version,
        prefix=plaintext[: len(token_prefix()) + 1 + DISPLAY_BODY_CHARS], last_four=plaintext[-4:],
    )
    return token, plaintext


def looks_like_token(candidate: str) -> bool:
    return candidate.startswith(token_prefix() + "_")


def verify(candidate: str) -> ManagementToken | None:
    """The usable token for ``candidate``, or None (malformed, unknown, revoked, expired, or
    its maker no longer an active owner of its tenant)."""
    parts = candidate.split("_")
    if len(parts) != 3 or len(parts[1]) != BODY_LEN or len(parts[2]) != CHECKSUM_LEN:
        return None
    if not hmac.compare_digest(checksum(parts[1]), parts[2]):
        return None
    hashes = [hash_key(candidate, v) for v in sorted(settings.API_KEY_PEPPERS, reverse=True)]
    token = (
        ManagementToken.objects.usable().select_related("tenant", "created_by")
        .filter(key_hash__in=hashes).first()
    )
    if token is None or not hmac.compare_digest(token.key_hash, hash_key(candidate,
                                                                          token.pepper_version)):
        return None
    _touch(token)
    return token


def _touch(token: ManagementToken) -> None:
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_EVERY:
        ManagementToken.objects.filter(pk=token.pk).update(last_used_at=now)


def revoke_made_by(user_id: int, tenant_id: int) -> int:
    """Revoke the tokens ``user_id`` made in ``tenant_id`` (they stopped working already when
    the maker stopped being an owner; this shows it on the tokens page)."""
    return ManagementToken.objects.filter(
        created_by_id=user_id, tenant_id=tenant_id, revoked_at__isnull=True
    ).update(revoked_at=timezone.now())
