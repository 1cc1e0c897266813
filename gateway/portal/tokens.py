"""Management tokens: ``<API_KEY_PREFIX>mgmt_<body>_<checksum>``, hashed like API keys.

The distinct prefix lets a secret scanner (and a human) tell a management token from an
inference key, and a token never parses as an API key, so it cannot call ``/v1/``.
The body, checksum and HMAC come from ``tenants.keys``.
"""

from __future__ import annotations

import hmac
import secrets
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from gateway.portal.models import ManagementToken
from tenants.keys import (
    BODY_LEN,
    CHECKSUM_LEN,
    DISPLAY_BODY_CHARS,
    RANDOM_BYTES,
    base62,
    checksum,
    current_pepper_version,
    hash_key,
)

LAST_USED_EVERY = timedelta(minutes=1)


def token_prefix() -> str:
    return f"{settings.API_KEY_PREFIX}mgmt"


def issue_token(tenant: object, name: str, role: str, *, created_by: object = None,
                expires_at: object = None) -> tuple[ManagementToken, str]:
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
    """The usable token for ``candidate``, or None (malformed, unknown, revoked or expired)."""
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
