"""OIDC bearer tokens for the inference API: a JWT from a tenant's own identity provider.

A tenant registers its provider (``IdentityProvider``: issuer, audience, JWKS URL or uploaded
JWKS, allowed algorithms, claim mapping). For a token we:

1. read the unverified ``iss`` and ``aud`` only to *find* the registration (issuer + audience
   are unique across tenants); the tenant is the registration's tenant, never a claim;
2. check the header's ``alg`` against the registration's allow-list, which can only hold
   asymmetric algorithms (``tenants.models.SIGNING_ALGORITHMS``): ``none`` and ``HS*`` never
   verify, so a public key can never be used as an HMAC secret;
3. verify with PyJWT: signature with the provider's key for the token's ``kid``, ``iss``,
   ``aud``, ``exp`` (required), ``nbf`` and ``iat`` when present, with a small leeway.

JWKS from a URL are cached per URL for ``OIDC_JWKS_CACHE_SECONDS`` and refetched at once when a
token names an unknown ``kid`` (key rotation at the provider), but at most once per
``OIDC_JWKS_MIN_REFRESH_SECONDS``, so random kids cannot make us hammer the provider.

Every failure is the same 401 as a bad API key (``tenants.auth.invalid_key``).

Principal: the tenant's limits; ``key_id`` is a synthetic negative id per registration
(``-2 * provider.pk``; mTLS bindings use odd negatives), so per-key buckets and counters are
separate per provider and can never collide with a real API key's (positive) id.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import jwt
from django.conf import settings

from tenants.models import SIGNING_ALGORITHMS, IdentityProvider

log = logging.getLogger(__name__)


class TokenRejected(Exception):
    """Why a token was refused (logged, never shown to the caller)."""


def synthetic_key_id(provider_id: int) -> int:
    return -2 * provider_id


# --- JWKS ------------------------------------------------------------------------------------

@dataclass
class _Jwks:
    keys: dict[str, jwt.PyJWK] = field(default_factory=dict)
    unnamed: list[jwt.PyJWK] = field(default_factory=list)
    fetched_at: float = float("-inf")


def _index(data: dict[str, Any]) -> _Jwks:
    out = _Jwks(fetched_at=time.monotonic())
    for entry in data.get("keys", []) if isinstance(data, dict) else []:
        try:
            jwk = jwt.PyJWK(entry)
        except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError):
            continue  # unusable or unsupported key: skip it, keep the rest
        if entry.get("use", "sig") != "sig":
            continue
        if entry.get("kid"):
            out.keys[str(entry["kid"])] = jwk
        else:
            out.unnamed.append(jwk)
    return out


class JwksCache:
    """Per-URL JWKS cache with refresh on an unknown kid, rate-limited. Thread-safe."""

    def __init__(self) -> None:
        self._sets: dict[str, _Jwks] = {}
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._sets.clear()

    def key_for(self, url: str, kid: str | None) -> jwt.PyJWK:
        now = time.monotonic()
        jwks = self._sets.get(url)
        if jwks is None or now - jwks.fetched_at > settings.OIDC_JWKS_CACHE_SECONDS:
            jwks = self._refresh(url)
        found = _pick(jwks, kid)
        if found is None and now - jwks.fetched_at >= settings.OIDC_JWKS_MIN_REFRESH_SECONDS:
            found = _pick(self._refresh(url), kid)  # the provider may have rotated its keys
        if found is None:
            raise TokenRejected(f"no key {kid!r} in the JWKS")
        return found

    def _refresh(self, url: str) -> _Jwks:
        client = jwt.PyJWKClient(url, cache_jwk_set=False, cache_keys=False,
                                 timeout=settings.OIDC_HTTP_TIMEOUT_SECONDS)
        try:
            data = client.fetch_data()
        except jwt.PyJWKClientError as exc:
            cached = self._sets.get(url)
            if cached is not None:  # keep serving the keys we had while the provider is down
                return cached
            raise TokenRejected(f"JWKS unreachable: {exc}") from exc
        jwks = _index(data)
        with self._lock:
            self._sets[url] = jwks
        return jwks


def _pick(jwks: _Jwks, kid: str | None) -> jwt.PyJWK | None:
    if kid is not None:
        return jwks.keys.get(str(kid))
    # No kid: only unambiguous when the provider publishes exactly one key.
    everything = [*jwks.keys.values(), *jwks.unnamed]
    return everything[0] if len(everything) == 1 else None


jwks_cache = JwksCache()


def signing_key(provider: IdentityProvider, kid: str | None) -> jwt.PyJWK:
    if provider.jwks_json:
        found = _pick(_index(provider.jwks_json), kid)
        if found is None:
            raise TokenRejected(f"no key {kid!r} in the uploaded JWKS")
        return found
    return jwks_cache.key_for(provider.jwks_url, kid)


# --- tokens ----------------------------------------------------------------------------------

def unverified_issuer_audiences(token: str) -> tuple[str, list[str]]:
    """Only to find the registration; nothing here is trusted until ``verify_token`` passes."""
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.PyJWTError as exc:
        raise TokenRejected(f"not a JWT: {exc}") from exc
    aud = claims.get("aud")
    auds = [aud] if isinstance(aud, str) else [a for a in aud or [] if isinstance(a, str)]
    iss = claims.get("iss")
    if not isinstance(iss, str) or not auds:
        raise TokenRejected("no iss or aud")
    return iss, auds


def verify_token(token: str, provider: IdentityProvider, *, audience: str,
                 nonce: str | None = None) -> dict[str, Any]:
    """Verify signature, alg, iss, aud, exp, nbf; returns the claims or raises TokenRejected."""
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError as exc:
        raise TokenRejected(f"bad header: {exc}") from exc
    alg = header.get("alg")
    allowed = [a for a in provider.algorithms or [] if a in SIGNING_ALGORITHMS]
    if not isinstance(alg, str) or alg not in allowed:
        raise TokenRejected(f"alg {alg!r} not allowed")
    jwk = signing_key(provider, header.get("kid"))
    if not _key_fits(jwk, alg):
        raise TokenRejected(f"the key for kid {header.get('kid')!r} is not a {alg} key")
    try:
        claims = jwt.decode(
            token, jwk.key, algorithms=[alg], audience=audience, issuer=provider.issuer,
            leeway=settings.OIDC_LEEWAY_SECONDS,
            options={"require": ["exp", "iss", "aud"], "verify_signature": True},
        )
    except (jwt.PyJWTError, ValueError, TypeError) as exc:
        raise TokenRejected(f"{type(exc).__name__}: {exc}") from exc
    if nonce is not None and claims.get("nonce") != nonce:
        raise TokenRejected("nonce mismatch")
    return claims


def _key_fits(jwk: jwt.PyJWK, alg: str) -> bool:
    published = getattr(jwk, "_jwk_data", {}).get("alg")
    if published and published != alg:
        return False
    kty = jwk.key_type
    return ((kty == "RSA" and alg[:2] in ("RS", "PS")) or (kty == "EC" and alg[:2] == "ES")
            or (kty == "OKP" and alg == "EdDSA"))


def find_provider(iss: str, auds: list[str]) -> IdentityProvider:
    """The one API-enabled registration a token's (unverified) iss and aud name."""
    found = list(IdentityProvider.objects.select_related("tenant__tier").filter(
        issuer=iss, audience__in=auds, api_enabled=True)[:2])
    if len(found) != 1:
        raise TokenRejected("no (or no unique) registration for this issuer and audience")
    return found[0]


def subject_of(claims: dict[str, Any], provider: IdentityProvider) -> str:
    """The claim the registration names as the caller's identity (default ``sub``)."""
    name = (provider.claim_mapping or {}).get("subject", "sub")
    value = claims.get(name)
    if not isinstance(value, str | int) or value == "":
        raise TokenRejected(f"no {name!r} claim")
    return str(value)


def looks_like_jwt(token: str) -> bool:
    return token.count(".") == 2 and len(token) > 20


def providers_for_tenant(tenant: object) -> list[IdentityProvider]:
    """The portal's view of one tenant's identity-provider registrations."""
    return list(IdentityProvider.objects.filter(tenant_id=getattr(tenant, "pk", tenant)))
