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
``OIDC_JWKS_MIN_REFRESH_SECONDS`` after the last attempt, with exponential backoff while the
provider fails, one fetch at a time (``JwksCache``), so random kids or an outage cannot make us
hammer the provider. Verification runs on its own threads (``tenants.auth``), never on the
thread API-key lookups use, so a hanging provider cannot delay API-key requests.

Every failure is the same 401 as a bad API key (``tenants.auth.invalid_key``).

Principal: the tenant's limits; ``key_id`` is a synthetic negative id per registration
(``-2 * provider.pk``; mTLS bindings use odd negatives), so per-key buckets and counters are
separate per provider and can never collide with a real API key's (positive) id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
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


@dataclass
class _Source:
    """One JWKS URL: the last good key set and when the provider may be asked again."""

    jwks: _Jwks | None = None
    attempted_at: float = float("-inf")  # last fetch attempt, successful or not
    failures: int = 0  # consecutive failed fetches
    # Single flight: held while one thread fetches; the others use what we have, or wait.
    fetching: threading.Lock = field(default_factory=threading.Lock)
    blocked: int = 0  # threads inside a blocking refresh (fetching or waiting), JwksCache._lock

    def next_fetch_at(self) -> float:
        """After a failure, wait min_refresh * 2^(failures-1), capped at the cache lifetime."""
        gap = settings.OIDC_JWKS_MIN_REFRESH_SECONDS
        if self.failures:
            gap = min(max(gap, 1.0) * 2 ** (self.failures - 1), settings.OIDC_JWKS_CACHE_SECONDS)
        return self.attempted_at + gap

    def stale(self, now: float) -> bool:
        return self.jwks is None or now - self.jwks.fetched_at > settings.OIDC_JWKS_CACHE_SECONDS


class JwksCache:
    """Per-URL JWKS cache. Thread-safe; an identity-provider outage costs one fetch per backoff.

    - Expired key set, or a token naming a kid we do not have (the provider may have rotated):
      refetch, but no sooner than ``next_fetch_at`` after the last *attempt*, successful or not.
      A failed fetch keeps the last good set and doubles the wait (up to the cache lifetime),
      so a dead or hanging provider sees one request per backoff period, not one per token.
      Unknown kids between attempts are answered from this negative state: no fetch at all.
    - One fetch per URL at a time: a thread that finds a fetch in flight uses the keys we have,
      and waits for the fetch only when it has none at all.
    """

    def __init__(self) -> None:
        self._sources: dict[str, _Source] = {}
        self._lock = threading.Lock()  # guards _sources only; never held during a fetch

    def clear(self) -> None:
        with self._lock:
            self._sources.clear()

    def _source(self, url: str) -> _Source:
        with self._lock:
            return self._sources.setdefault(url, _Source())

    def key_for(self, url: str, kid: str | None) -> jwt.PyJWK:
        source = self._source(url)
        now = time.monotonic()
        jwks = source.jwks
        found = _pick(jwks, kid) if jwks is not None else None
        if (found is None or source.stale(now)) and now >= source.next_fetch_at():
            jwks = self._refresh(url, source, wait=jwks is None) or jwks
            found = _pick(jwks, kid) if jwks is not None else None
        if jwks is None:
            raise TokenRejected("JWKS unreachable and none cached")
        if found is None:
            raise TokenRejected(f"no key {kid!r} in the JWKS")
        return found

    def _refresh(self, url: str, source: _Source, *, wait: bool) -> _Jwks | None:
        """Fetch unless another thread is; returns the newest key set we have.

        A thread that must wait (no keys at all yet) counts against the provider's share of
        the identity threads: past ``MAX_BLOCKED_PER_PROVIDER`` it is refused at once, so one
        slow provider holds at most that many of the shared threads (review 3, N7)."""
        if wait:
            with self._lock:
                if source.blocked >= MAX_BLOCKED_PER_PROVIDER:
                    return source.jwks
                source.blocked += 1
        try:
            return self._refresh_once(url, source, wait=wait)
        finally:
            if wait:
                with self._lock:
                    source.blocked -= 1

    def _refresh_once(self, url: str, source: _Source, *, wait: bool) -> _Jwks | None:
        timeout = settings.OIDC_HTTP_TIMEOUT_SECONDS
        if not source.fetching.acquire(blocking=wait, timeout=timeout + 1 if wait else -1):
            return source.jwks  # someone else is asking the provider right now
        try:
            if time.monotonic() < source.next_fetch_at():
                return source.jwks  # the fetch we waited for has just happened
            source.attempted_at = time.monotonic()
            try:
                data = fetch_jwks(url, timeout)
            except JwksUnavailable as exc:
                source.failures += 1
                log.warning("JWKS %s unreachable (%d in a row), next try in %.0fs: %s", url,
                            source.failures, source.next_fetch_at() - time.monotonic(), exc)
                return source.jwks  # keep serving the keys we had while the provider is down
            source.failures = 0
            source.jwks = _index(data)
            return source.jwks
        finally:
            source.fetching.release()


# At most this many identity threads block on one provider's JWKS (one fetching, one waiting).
MAX_BLOCKED_PER_PROVIDER = 2
MAX_JWKS_BYTES = 512 * 1024


class JwksUnavailable(Exception):
    """The JWKS could not be fetched within the deadline, or is not a JSON object."""


def fetch_jwks(url: str, deadline_s: float) -> dict[str, Any]:
    """GET a JWKS with one deadline on the whole fetch (connect, headers and body), not per
    socket read: a provider trickling a byte every two seconds used to hold an identity
    thread for minutes (review 3, N7). Runs a short-lived event loop in the calling (identity)
    thread so ``wait_for`` can cut the fetch off at any point."""
    try:
        data = asyncio.run(asyncio.wait_for(_get_json(url, deadline_s), deadline_s))
    except TimeoutError:
        raise JwksUnavailable(f"no complete answer within {deadline_s:g}s") from None
    except (httpx.HTTPError, ValueError) as exc:
        raise JwksUnavailable(str(exc) or type(exc).__name__) from None
    if not isinstance(data, dict):
        raise JwksUnavailable("the JWKS is not a JSON object")
    return data


async def _get_json(url: str, deadline_s: float) -> Any:
    async with httpx.AsyncClient(timeout=deadline_s, follow_redirects=True) as client, \
            client.stream("GET", url, headers={"accept": "application/json"}) as response:
        response.raise_for_status()
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > MAX_JWKS_BYTES:
                raise ValueError(f"the JWKS is larger than {MAX_JWKS_BYTES} bytes")
    return json.loads(bytes(body))


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
