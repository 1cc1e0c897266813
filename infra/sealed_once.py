"""A secret parked between the POST that mints it and the one GET that shows it.

POST-redirect-GET keeps a reload from minting a second key, but the plaintext has to live
somewhere between the two requests. Parked in the session as it is, it would sit in the
session store (the database by default, and its backups) until the GET reads it, or until the
session expires if the browser never follows the redirect.

So the payload is sealed (AES-GCM, a fresh 128-bit key per secret): the session holds only the
ciphertext and the browser holds only the key, in a short-lived cookie scoped to the GET.
Neither a dump of the session store nor the cookie alone reveals the secret; an abandoned
redirect leaves ciphertext nobody can open. The session key's name is bound into the
ciphertext as associated data, so a sealed key cannot be replayed into another parking slot.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from django.conf import settings
from django.http import HttpRequest, HttpResponse

COOKIE = "igw_secret_once"
COOKIE_MAX_AGE_S = 300  # time to follow one redirect, with room for a slow phone
_NONCE_BYTES = 12


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii")


def seal(slot: str, payload: dict[str, Any]) -> tuple[str, str]:
    """``(sealed, key)``: the sealed payload for the session and the key for the browser."""
    key = AESGCM.generate_key(bit_length=128)
    nonce = os.urandom(_NONCE_BYTES)
    body = AESGCM(key).encrypt(nonce, json.dumps(payload).encode(), slot.encode())
    return _b64(nonce + body), _b64(key)


def unseal(slot: str, sealed: str, key: str) -> dict[str, Any] | None:
    """The payload, or None when either half is missing, altered, or from another slot."""
    try:
        blob = base64.urlsafe_b64decode(sealed.encode("ascii"))
        raw_key = base64.urlsafe_b64decode(key.encode("ascii"))
        plain = AESGCM(raw_key).decrypt(blob[:_NONCE_BYTES], blob[_NONCE_BYTES:], slot.encode())
        payload = json.loads(plain)
    except (InvalidTag, ValueError, binascii.Error, UnicodeError):
        return None
    return payload if isinstance(payload, dict) else None


def park(request: HttpRequest, response: HttpResponse, slot: str,
         payload: dict[str, Any]) -> HttpResponse:
    """Seal ``payload`` into ``request.session[slot]`` and hand its key to the browser."""
    sealed, key = seal(slot, payload)
    request.session[slot] = sealed
    response.set_cookie(COOKIE, key, max_age=COOKIE_MAX_AGE_S, httponly=True,
                        secure=request.is_secure() or settings.SESSION_COOKIE_SECURE,
                        samesite="Strict")
    return response


def take(request: HttpRequest, slot: str) -> dict[str, Any] | None:
    """The parked payload, removed from the session as it is read: shown at most once."""
    sealed = request.session.pop(slot, None)
    key = request.COOKIES.get(COOKIE)
    if not isinstance(sealed, str) or not key:
        return None
    return unseal(slot, sealed, key)


def forget_key(response: HttpResponse) -> HttpResponse:
    """Drop the browser's half once the secret is shown (or found gone)."""
    response.delete_cookie(COOKIE, samesite="Strict")
    return response
