"""API key format, generation, checksum and hashing.

A key reads ``<prefix>_<body>_<checksum>``:

- ``prefix`` is ``settings.API_KEY_PREFIX`` so secret scanners can pattern-match a leak;
- ``body`` is 32 bytes from ``secrets`` (256 bits) in base62, fixed width 43;
- ``checksum`` is the CRC32 of the body in base62, fixed width 6, so a scanner can tell a real
  key from a look-alike offline (and a typo fails before any lookup).

Only ``HMAC-SHA256(pepper[version], key)`` is stored. Peppers live in settings, never in the
database, so a database dump alone cannot confirm a guessed key. Several pepper versions may be
live during a rotation: new keys use the highest, old keys verify under the one stored beside
their hash. The plaintext is returned once by ``issue_key`` and never logged or stored.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import zlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from catalog.models import ServedModel
from tenants.models import LIMIT_FIELDS, ApiKey, Tenant

if TYPE_CHECKING:
    from django.contrib.auth.models import User

ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
RANDOM_BYTES = 32
BODY_LEN = 43  # ceil(256 / log2(62)): every 32-byte value fits, zero-padded to a fixed width
CHECKSUM_LEN = 6  # 62**6 > 2**32, so any CRC32 fits
DISPLAY_BODY_CHARS = 8  # shown after the prefix to identify a key; ~47 of its 256 bits
# Anything longer cannot be a key; capping what we hash bounds the work a junk header can cause.
MAX_KEY_LEN = 64

_BODY_RE = re.compile(rf"[0-9A-Za-z]{{{BODY_LEN}}}")
_CHECKSUM_RE = re.compile(rf"[0-9A-Za-z]{{{CHECKSUM_LEN}}}")


@dataclass(frozen=True)
class ParsedKey:
    prefix: str
    body: str
    checksum: str


def base62(number: int, width: int) -> str:
    """``number`` in base62, left-padded with zeros to ``width`` characters."""
    digits = []
    while number:
        number, rem = divmod(number, 62)
        digits.append(ALPHABET[rem])
    return "".join(reversed(digits)).rjust(width, ALPHABET[0])


def checksum(body: str) -> str:
    return base62(zlib.crc32(body.encode()), CHECKSUM_LEN)


def generate_key() -> str:
    body = base62(int.from_bytes(secrets.token_bytes(RANDOM_BYTES), "big"), BODY_LEN)
    return f"{settings.API_KEY_PREFIX}_{body}_{checksum(body)}"


def parse_key(candidate: str) -> ParsedKey | None:
    """Split a key into its parts, or None if it is not a well-formed key of ours.

    Every check runs whatever the earlier ones said (no early return), so a malformed string
    costs the same as a well-formed one with a bad checksum.
    """
    text = candidate[:MAX_KEY_LEN + 1] if isinstance(candidate, str) else ""
    parts = text.split("_")
    prefix, body, check = [*parts, "", "", ""][:3] if len(parts) <= 3 else ("", "", "")
    ok_shape = len(parts) == 3 and len(text) <= MAX_KEY_LEN
    ok_prefix = hmac.compare_digest(prefix.encode(), settings.API_KEY_PREFIX.encode())
    ok_body = _BODY_RE.fullmatch(body) is not None
    ok_check = _CHECKSUM_RE.fullmatch(check) is not None
    ok_crc = hmac.compare_digest(checksum(body).encode(), check.encode())
    if ok_shape & ok_prefix & ok_body & ok_check & ok_crc:
        return ParsedKey(prefix, body, check)
    return None


def hash_key(key: str, version: int) -> str:
    """HMAC-SHA256 of the key under pepper ``version``, hex. Raises KeyError for an unknown one."""
    pepper = settings.API_KEY_PEPPERS[version]
    return hmac.new(pepper.encode(), key[:MAX_KEY_LEN + 1].encode(), hashlib.sha256).hexdigest()


def current_pepper_version() -> int:
    return max(settings.API_KEY_PEPPERS)


def candidate_hashes(key: str) -> list[tuple[int, str]]:
    """(version, hash) under every live pepper, newest first: one lookup finds old and new keys."""
    return [(v, hash_key(key, v)) for v in sorted(settings.API_KEY_PEPPERS, reverse=True)]


def display_prefix(key: str) -> str:
    return key[: len(settings.API_KEY_PREFIX) + 1 + DISPLAY_BODY_CHARS]


def assign_secret(api_key: ApiKey) -> str:
    """Give an unsaved ApiKey a fresh secret; return the plaintext (the caller shows it once)."""
    plaintext = generate_key()
    version = current_pepper_version()
    api_key.key_hash = hash_key(plaintext, version)
    api_key.pepper_version = version
    api_key.prefix = display_prefix(plaintext)
    api_key.last_four = plaintext[-4:]
    return plaintext


def issue_key(
    tenant: Tenant,
    name: str,
    *,
    allowed_models: tuple[ServedModel, ...] | list[ServedModel] = (),
    expires_at: datetime | None = None,
    created_by: User | None = None,
    **limits: Any,
) -> tuple[ApiKey, str]:
    """Create a key for ``tenant``; return it with its plaintext, which is never stored."""
    api_key = ApiKey(
        tenant=tenant, name=name, expires_at=expires_at, created_by=created_by, **limits
    )
    plaintext = assign_secret(api_key)
    with transaction.atomic():
        api_key.save()
        if allowed_models:
            api_key.allowed_models.set(allowed_models)
    return api_key, plaintext


class KeyNotRotatable(ValueError):
    """Only a usable key (not revoked, not expired) can be rotated."""


def rotate_key(
    old: ApiKey, grace: timedelta, *, created_by: User | None = None,
) -> tuple[ApiKey, str]:
    """Issue a successor to ``old`` and let ``old`` expire after ``grace``; return the successor
    and its plaintext. The one rule for rotation, behind the portal and the management API.

    The successor keeps the name, the models, the expiry and the limits of ``old``. The grace
    never extends ``old`` past the expiry it already had. The old row is locked while it is
    checked and shortened, so a rotation racing a revocation either sees the key revoked and
    refuses, or shortens it before the revocation lands; never revives it.
    """
    with transaction.atomic():
        locked = ApiKey.objects.select_for_update().get(pk=old.pk)
        if not locked.is_usable():
            raise KeyNotRotatable("Only a usable key can be rotated.")
        if locked.rotated_at is not None:
            raise KeyNotRotatable("This key was already rotated: rotate its successor.")
        new, plaintext = issue_key(
            locked.tenant, locked.name, allowed_models=list(locked.allowed_models.all()),
            expires_at=locked.expires_at, created_by=created_by,
            **{f: getattr(locked, f) for f in LIMIT_FIELDS if getattr(locked, f) is not None},
        )
        until = timezone.now() + grace
        locked.expires_at = min(until, locked.expires_at) if locked.expires_at else until
        locked.rotated_at = timezone.now()
        # the save signal drops cached principals
        locked.save(update_fields=["expires_at", "rotated_at"])
    old.expires_at, old.rotated_at = locked.expires_at, locked.rotated_at
    return new, plaintext
