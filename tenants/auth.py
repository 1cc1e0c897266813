"""Authentication for the inference API: ``Authorization: Bearer <key>`` -> ``Principal``.

The tenant comes only from the verified key (I1). Headers such as ``OpenAI-Organization`` or
``X-Tenant-Id`` and body fields are never read here, so they cannot move a request to another
tenant; callers use ``authenticate_scope`` / ``aauthenticate_scope`` and the Principal's ids.

Same answer, same work. Revoked, expired, unknown and malformed keys all raise the same 401.
Every call computes the HMAC under every live pepper and makes the same indexed lookup, whatever
the input looked like; revoked and expired keys are filtered out in that same SQL query, so they
take the path of an unknown key. The stored hash is compared in constant time.

Caching and revocation. A process keeps principals for ``AUTH_CACHE_SECONDS`` keyed by key hash.
Every call also checks the *auth epoch*, a random token in Redis rewritten whenever a key,
tenant, tier or quota changes; a cached principal is only used under the epoch it was loaded
with. The sync path reads the key per call (one GET). The async path, the gateway's, uses the
value a watcher thread keeps (``tenants.epoch``: a pub/sub message on every change, and a read
at least every ``epoch.POLL_S`` whatever happens, so a lost message delays a revocation by that
much at most), and reads the key itself only while that value is not fresh: no round trip per
request (issue 30). Revocation therefore takes effect at once in the process that made it and
within one pub/sub delivery (``epoch.POLL_S`` at worst) in every other; the TTL is only a
backstop for when Redis cannot be read.

Database outage. When the lookup itself fails (the database is unreachable), a principal this
process verified before is still used for ``AUTH_STALE_SECONDS`` (default 300) after it was
loaded, but only under the current epoch: nothing can be revoked while the database is down
(revoking writes to it), and a revocation made before the outage changed the epoch, so it still
holds. Without such an entry, or when Redis cannot be read either (no epoch to check), the
request fails closed with 503 ``auth_unavailable``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any

import redis
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from infra.clientaddr import peer_address
from infra.redis_conn import get_async_redis, get_redis
from tenants import epoch, mtls, oidc
from tenants.api_keys import candidate_hashes, parse_key
from tenants.budgets import KeyBudgets, key_budgets
from tenants.limits import Limits, quota_table, resolve
from tenants.models import LIMIT_FIELDS, ApiKey, Tenant
from tenants.salts import cache_salt

log = logging.getLogger(__name__)

INVALID_KEY_MESSAGE = "Incorrect API key provided."
SUSPENDED_MESSAGE = (
    "Your organization's access to the API has been suspended. "
    "Contact the platform administrator."
)
LAST_USED_EVERY_S = 60.0  # write last_used_at at most this often per key
_MAX_CACHE_ENTRIES = 50_000


class AuthError(Exception):
    """An authentication failure, with the OpenAI-shaped body the API returns for it."""

    def __init__(self, status: int, code: str, message: str,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.type = type_

    @property
    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": None,
                          "code": self.code}}

    @property
    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}


def invalid_key() -> AuthError:
    return AuthError(401, "invalid_api_key", INVALID_KEY_MESSAGE)


def auth_unavailable() -> AuthError:
    return AuthError(503, "auth_unavailable",
                     "Authentication is temporarily unavailable; please retry.", "server_error")


def tenant_suspended() -> AuthError:
    return AuthError(403, "tenant_suspended", SUSPENDED_MESSAGE, "permission_error")


@dataclass(frozen=True)
class KeyCaps:
    """Per-key limits under the tenant's; None = the tenant's limit applies."""

    input_tpm: int | None = None
    output_tpm: int | None = None
    concurrent_requests: int | None = None
    open_streams: int | None = None
    max_output_tokens: int | None = None

    def as_dict(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in LIMIT_FIELDS if getattr(self, f) is not None}


@dataclass(frozen=True)
class Principal:
    """Who is calling, as proven by the key. Everything downstream is keyed on ``tenant_id``."""

    tenant_id: int
    tenant_slug: str
    tenant_weight: float
    tenant_region: str
    key_id: int
    key_prefix: str
    allowed_model_names: frozenset[str]  # empty = every model the tenant may use
    key_caps: KeyCaps
    content_logging: bool = False
    response_cache: bool = False  # opted in, by its tenant or its key (gateway.inference.cache)
    tenant_active: bool = True
    expires_at: datetime | None = None
    tenant_cells: tuple[str, ...] = ()  # home first; () = no cells (docs/adr/0019)
    # Quota rows by model name (None = tenant default), so limits resolve without the database.
    quotas: Mapping[str | None, Mapping[str, Any]] = field(
        default_factory=dict, compare=False, repr=False
    )
    project_id: int | None = None
    project_model_names: frozenset[str] = frozenset()  # empty = the project narrows nothing
    budgets: KeyBudgets = field(default_factory=KeyBudgets, compare=False, repr=False)
    end_user_header: str = ""  # the tenant's header naming end users ('' = the body's field)
    over_budget: bool = False  # a spend alert's hard cap stopped this key (429, not 401)

    def allows_model(self, model_name: str) -> bool:
        return all(not names or model_name in names
                   for names in (self.allowed_model_names, self.project_model_names))

    def limits(self, model_name: str | None = None) -> Limits:
        """Effective limits for one request: tenant quota, model override, key caps (min)."""
        return resolve(self.quotas.get(None), self.quotas.get(model_name), self.key_caps.as_dict())

    def tenant_limits(self, model_name: str | None = None) -> Limits:
        """The tenant's own limits (its shared buckets), without this key's caps."""
        return resolve(self.quotas.get(None), self.quotas.get(model_name))

    @property
    def cache_salt(self) -> str:
        return cache_salt(self.tenant_id)


# --- the header --------------------------------------------------------------------------------

def bearer_token(header_value: str | bytes | None) -> str:
    """The credential in an Authorization value; "" when there is none (treated as malformed)."""
    if isinstance(header_value, bytes):
        header_value = header_value.decode("latin-1")
    scheme, _, token = (header_value or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def authorization_from_scope(scope: Mapping[str, Any]) -> str | None:
    """The one Authorization header of an ASGI scope. Two of them are ambiguous: treat as none."""
    values = [v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"]
    return values[0].decode("latin-1") if len(values) == 1 else None


def authenticate_scope(scope: Mapping[str, Any]) -> Principal:
    """The helper the inference API uses: reads Authorization and nothing else."""
    return authenticate(authorization_from_scope(scope))


async def aauthenticate_scope(scope: Mapping[str, Any]) -> Principal:
    return await aauthenticate(authorization_from_scope(scope))


# --- authenticate --------------------------------------------------------------------------------

def authenticate(authorization: str | bytes | None) -> Principal:
    """Verify a credential (the Authorization header value) and return its Principal."""
    well_formed, hashes = _digest(authorization)
    epoch = _read_epoch()
    principal = _cached(hashes, epoch)
    if principal is None:
        try:
            found = _load(hashes, well_formed)
        except DatabaseError:
            return _admit(_stale(hashes, epoch))
        _store(found, epoch)
        principal = found[0] if found else None
    return _admit(principal)


async def aauthenticate(authorization: str | bytes | None) -> Principal:
    """``authenticate`` for the event loop: a cache hit does no DB work, a miss runs in a thread."""
    well_formed, hashes = _digest(authorization)
    epoch = await _aread_epoch()
    principal = _cached(hashes, epoch)
    if principal is None:
        try:
            found = await _aload(hashes, well_formed, epoch)
        except DatabaseError:
            return _admit(_stale(hashes, epoch))
        _store(found, epoch)
        principal = found[0] if found else None
    return _admit(principal)


# Cache misses being loaded, per event loop, credential and auth epoch: when a busy key's entry
# expires (every AUTH_CACHE_SECONDS), the requests that arrive during the lookup share that one
# query instead of each taking a database thread and connection (the overhead benchmark's p99
# tail). The epoch is part of the flight: a request that saw a newer epoch (a revocation) must
# not take a lookup that began before it, or it would cache a revoked key under the new epoch.
_Flight = tuple[int, tuple[tuple[int, str], ...], bool, bytes | None]
_loading: dict[_Flight, asyncio.Future[tuple[Principal, str] | None]] = {}


class _LeaderGone(Exception):
    """The request doing a shared lookup was cancelled (its client left): lead one anew."""


async def _aload(hashes: list[tuple[int, str]], well_formed: bool,
                 epoch: bytes | None) -> tuple[Principal, str] | None:
    loop = asyncio.get_running_loop()
    flight: _Flight = (id(loop), tuple(hashes), well_formed, epoch)
    while (shared := _loading.get(flight)) is not None and shared.get_loop() is loop:
        try:
            # shield: a follower that goes away must not cancel the others' lookup.
            return await asyncio.shield(shared)
        except _LeaderGone:
            continue
    # The leader runs the query in its own task, as an unshared lookup would (Django's
    # thread-sensitive database calls follow the caller's context).
    mine: asyncio.Future[tuple[Principal, str] | None] = loop.create_future()
    _loading[flight] = mine
    try:
        found: tuple[Principal, str] | None = await database_sync_to_async(_load)(
            hashes, well_formed)
    except BaseException as exc:
        _land(flight, mine)
        mine.set_exception(exc if isinstance(exc, Exception) else _LeaderGone())
        mine.exception()  # retrieved, even if nobody was waiting
        raise
    _land(flight, mine)
    mine.set_result(found)
    return found


def _land(flight: _Flight, mine: asyncio.Future[Any]) -> None:
    if _loading.get(flight) is mine:
        del _loading[flight]


def _digest(authorization: str | bytes | None) -> tuple[bool, list[tuple[int, str]]]:
    # Hash whatever came, even junk, so a malformed key costs what a wrong one costs.
    token = bearer_token(authorization)
    return parse_key(token) is not None, candidate_hashes(token)


def _admit(principal: Principal | None) -> Principal:
    if principal is None:
        raise invalid_key()
    if principal.expires_at is not None and principal.expires_at <= timezone.now():
        raise invalid_key()  # expired while cached
    if not principal.tenant_active:
        raise tenant_suspended()
    _note_use(principal.key_id)
    return principal


def _load(hashes: list[tuple[int, str]], well_formed: bool) -> tuple[Principal, str] | None:
    """One indexed query whatever the input; revoked and expired rows never come back."""
    rows = list(
        ApiKey.objects.usable().select_related("tenant__tier", "project")
        .filter(key_hash__in=[h for _, h in hashes])[:1]
    )
    row = rows[0] if rows else None
    expected = dict(hashes).get(row.pepper_version, "") if row else ""
    # The row's own pepper version must produce its hash: a retired pepper retires its keys.
    matches = hmac.compare_digest(row.key_hash if row else "-", expected or "+")
    if not (row and matches and well_formed):
        return None
    return _principal(row), row.key_hash


def _principal(row: ApiKey) -> Principal:
    tenant: Tenant = row.tenant
    return Principal(
        tenant_id=tenant.pk,
        tenant_slug=tenant.slug,
        tenant_weight=tenant.tier.weight,
        tenant_region=tenant.region,
        key_id=row.pk,
        key_prefix=row.prefix,
        allowed_model_names=frozenset(row.allowed_models.values_list("name", flat=True)),
        key_caps=KeyCaps(**{f: getattr(row, f) for f in LIMIT_FIELDS}),
        content_logging=tenant.content_logging,
        response_cache=tenant.response_cache or row.response_cache,
        tenant_active=tenant.is_active,
        expires_at=row.expires_at,
        tenant_cells=tenant.cells,
        quotas=MappingProxyType(quota_table(tenant)),
        project_id=row.project_id,
        project_model_names=frozenset(row.project.allowed_models.values_list("name", flat=True))
        if row.project is not None else frozenset(),
        budgets=key_budgets(tenant.pk, row.project_id, row.pk,
                            tenant.budgets.filter(enabled=True)),
        end_user_header=tenant.end_user_header,
        over_budget=row.over_budget_at is not None,
    )


# --- the process-local cache and the Redis epoch ---------------------------------------------

@dataclass(frozen=True)
class _Entry:
    principal: Principal
    fresh_until: float
    epoch: bytes | None


_cache: dict[str, _Entry] = {}


def _epoch_key() -> str:
    return epoch.epoch_key()


def _as_bytes(value: bytes | str | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def _read_epoch() -> bytes | None:
    try:
        return _as_bytes(get_redis().get(_epoch_key())) or b"-"
    except redis.RedisError as exc:
        log.warning("auth epoch unreadable, trusting the %ss cache TTL only: %s",
                    settings.AUTH_CACHE_SECONDS, type(exc).__name__)
        return None


async def _aread_epoch() -> bytes | None:
    # The watcher's reading (tenants.epoch): no round trip per request while it is fresh.
    seen = epoch.current()
    if seen is not None:
        return seen
    try:
        return _as_bytes(await get_async_redis().get(_epoch_key())) or b"-"
    except redis.RedisError as exc:
        log.warning("auth epoch unreadable, trusting the %ss cache TTL only: %s",
                    settings.AUTH_CACHE_SECONDS, type(exc).__name__)
        return None


def _cached(hashes: list[tuple[int, str]], epoch: bytes | None) -> Principal | None:
    now = time.monotonic()
    for _, digest in hashes:
        entry = _cache.get(digest)
        if entry and entry.epoch == epoch and now < entry.fresh_until:
            return entry.principal
    return None


def _stale(hashes: list[tuple[int, str]], epoch: bytes | None) -> Principal:
    """The database is down: a principal verified under this epoch, if not too old (see the
    module docstring), else fail closed."""
    log.warning("auth lookup failed (database unavailable); using cached principals only")
    if epoch is None:
        raise auth_unavailable()
    now = time.monotonic()
    for _, digest in hashes:
        entry = _cache.get(digest)
        loaded = entry.fresh_until - settings.AUTH_CACHE_SECONDS if entry else 0.0
        if entry and entry.epoch == epoch and now - loaded < settings.AUTH_STALE_SECONDS:
            return entry.principal
    raise auth_unavailable()


def _store(found: tuple[Principal, str] | None, epoch: bytes | None) -> None:
    # Only keys that verified are cached: failures must cost what an unknown key costs.
    if found is None or settings.AUTH_CACHE_SECONDS <= 0:
        return
    if len(_cache) >= _MAX_CACHE_ENTRIES:
        _cache.clear()
    principal, digest = found
    _cache[digest] = _Entry(principal, time.monotonic() + settings.AUTH_CACHE_SECONDS, epoch)


def clear_cache() -> None:
    """Drop this process's cached principals (tests, and after this process changes a key)."""
    _cache.clear()
    _other_cache.clear()
    _registrations.clear()


def invalidate_principals() -> None:
    """Make every gateway process re-read keys and tenants on its next request.

    Written now (so this process and tests see it at once) and again after the transaction
    commits: a process that reloaded between the two writes could have read the old row, and
    the second write forces it to reload the committed one.
    """
    clear_cache()
    _publish_epoch()
    transaction.on_commit(_publish_epoch)


def _publish_epoch() -> None:
    value = uuid.uuid4().hex
    epoch.changed_here(value.encode())
    try:
        # The key first: a watcher woken by the message reads it (tenants.epoch). Two calls,
        # not a pipeline: Redis Cluster's client refuses PUBLISH in one; a change is rare.
        client = get_redis()
        client.set(_epoch_key(), value)
        client.publish(epoch.channel(), value)
    except redis.RedisError as exc:
        log.error("could not publish the auth epoch (revocations wait for the %ss TTL): %s",
                  settings.AUTH_CACHE_SECONDS, type(exc).__name__)


# --- last_used_at, off the hot path ---------------------------------------------------------------

_touched: dict[int, float] = {}
_touch_lock = threading.Lock()
_writers: dict[int, ThreadPoolExecutor] = {}
_writers_lock = threading.Lock()


def _writer() -> ThreadPoolExecutor:
    """This process's writer thread. Per pid: a forked child (Celery prefork, uvicorn workers)
    inherits the executor object but not its thread, and would queue writes forever."""
    pid = os.getpid()
    with _writers_lock:
        if pid not in _writers:
            _writers.clear()
            _writers[pid] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="last-used")
        return _writers[pid]


def _note_use(key_id: int) -> None:
    now = time.monotonic()
    with _touch_lock:
        if now - _touched.get(key_id, -LAST_USED_EVERY_S) < LAST_USED_EVERY_S:
            return
        if len(_touched) >= _MAX_CACHE_ENTRIES:
            _touched.clear()
        _touched[key_id] = now
    _writer().submit(_write_last_used, key_id)


def _write_last_used(key_id: int) -> None:
    """One conditional UPDATE: across all processes a key's row is written at most once a minute."""
    try:
        now = timezone.now()
        ApiKey.objects.filter(pk=key_id).filter(
            Q(last_used_at__isnull=True) | Q(last_used_at__lt=now - timedelta(
                seconds=LAST_USED_EVERY_S))
        ).update(last_used_at=now)
    except Exception as exc:  # bookkeeping must never break authentication
        log.warning("last_used_at not written for key %s: %s", key_id, type(exc).__name__)
    finally:
        connection.close()  # this thread's own connection; don't hold one open between writes


def flush_last_used(timeout: float = 5.0) -> None:
    """Wait for queued last_used_at writes (tests, graceful shutdown)."""
    done: Future[None] = _writer().submit(lambda: None)
    done.result(timeout=timeout)


def forget_usage(key_ids: Iterable[int] | None = None) -> None:
    """Forget when keys were last written, so the next use writes again (tests)."""
    with _touch_lock:
        if key_ids is None:
            _touched.clear()
        for key_id in key_ids or ():
            _touched.pop(key_id, None)


# --- OIDC bearer tokens and mutual TLS (tenants.oidc, tenants.mtls) --------------------------
#
# ``authenticate_request`` tries, in order: an API key in Authorization, an OIDC JWT in
# Authorization, then a client certificate forwarded by a trusted proxy. The first credential
# presented decides: a bad one is a 401 and never falls through to the next kind. Principals for
# OIDC registrations and certificate bindings carry the tenant's limits and a synthetic negative
# ``key_id`` (even: OIDC registration, odd: certificate), so per-key counters stay separate per
# credential and never collide with API keys. They are cached like key principals, under the
# auth epoch (registrations and bindings bump it on save/delete).

_other_cache: dict[tuple[Any, ...], _Entry] = {}


def principal_for_tenant(tenant: Tenant, *, key_id: int, key_prefix: str) -> Principal:
    """A Principal with the tenant's own limits, for credentials that are not API keys."""
    return Principal(
        tenant_id=tenant.pk,
        tenant_slug=tenant.slug,
        tenant_weight=tenant.tier.weight,
        tenant_region=tenant.region,
        key_id=key_id,
        key_prefix=key_prefix,
        allowed_model_names=frozenset(),
        key_caps=KeyCaps(),
        content_logging=tenant.content_logging,
        response_cache=tenant.response_cache,
        tenant_active=tenant.is_active,
        tenant_cells=tenant.cells,
        quotas=MappingProxyType(quota_table(tenant)),
        budgets=key_budgets(tenant.pk, None, key_id, tenant.budgets.filter(enabled=True)),
        end_user_header=tenant.end_user_header,
    )


def _other_cached(cache_key: tuple[Any, ...]) -> tuple[Principal, Any] | None:
    entry = _other_cache.get(cache_key)
    if entry and entry.epoch == _read_epoch() and time.monotonic() < entry.fresh_until:
        return entry.principal, entry
    return None


def _other_store(cache_key: tuple[Any, ...], principal: Principal) -> None:
    if settings.AUTH_CACHE_SECONDS <= 0:
        return
    if len(_other_cache) >= _MAX_CACHE_ENTRIES:
        _other_cache.clear()
    _other_cache[cache_key] = _Entry(
        principal, time.monotonic() + settings.AUTH_CACHE_SECONDS, _read_epoch()
    )


def _admit_tenant(principal: Principal) -> Principal:
    if not principal.tenant_active:
        raise tenant_suspended()
    return principal


def authenticate_jwt(token: str) -> Principal:
    """Verify an OIDC bearer JWT against its tenant's registration; the same 401 on failure.

    With a warm cache this makes no database query: the registration and its Principal are
    cached per (iss, aud) under the auth epoch; the signature and claims are checked every time.
    """
    try:
        iss, auds = oidc.unverified_issuer_audiences(token)
        provider, principal = _registration(oidc, iss, auds)
        claims = oidc.verify_token(token, provider, audience=provider.audience)
        oidc.subject_of(claims, provider)
    except oidc.TokenRejected as exc:
        log.info("OIDC token rejected: %s", exc)
        raise invalid_key() from None
    return _admit_tenant(principal)


_registrations: dict[tuple[str, tuple[str, ...]], tuple[Any, Principal, float, Any]] = {}


def _registration(oidc: Any, iss: str, auds: list[str]) -> tuple[Any, Principal]:
    cache_key = (iss, tuple(sorted(auds)))
    epoch = _read_epoch()
    hit = _registrations.get(cache_key)
    if hit and hit[3] == epoch and time.monotonic() < hit[2]:
        return hit[0], hit[1]
    provider = oidc.find_provider(iss, auds)
    principal = principal_for_tenant(
        provider.tenant, key_id=oidc.synthetic_key_id(provider.pk), key_prefix=f"oidc:{provider.pk}"
    )
    if settings.AUTH_CACHE_SECONDS > 0:
        if len(_registrations) >= _MAX_CACHE_ENTRIES:
            _registrations.clear()
        _registrations[cache_key] = (provider, principal,
                                     time.monotonic() + settings.AUTH_CACHE_SECONDS, epoch)
    return provider, principal


def authenticate_certificate(fingerprint: str) -> Principal:
    """The tenant a client certificate (SHA-256 fingerprint) is bound to; 401 if none."""
    cache_key = ("mtls", fingerprint)
    hit = _other_cached(cache_key)
    if hit:
        return _admit_tenant(hit[0])
    binding = mtls.binding_for(fingerprint)
    if binding is None:
        raise invalid_key()
    principal = principal_for_tenant(
        binding.tenant, key_id=mtls.synthetic_key_id(binding.pk),
        key_prefix=f"mtls:{fingerprint[:12]}",
    )
    _other_store(cache_key, principal)
    return _admit_tenant(principal)


def _single(headers: Mapping[str, str], name: str) -> str | None:
    values = [v for k, v in headers.items() if k.lower() == name]
    return values[0] if len(values) == 1 else None


def authenticate_request(headers: Mapping[str, str], client_ip: str | None) -> Principal:
    """API key, then OIDC bearer JWT, then a trusted proxy's client certificate."""
    authorization = _single(headers, "authorization")
    token = bearer_token(authorization)
    if token:
        if parse_key(token) is None and oidc.looks_like_jwt(token):
            return authenticate_jwt(token)
        return authenticate(authorization)
    fingerprint = mtls.client_fingerprint(headers, client_ip)
    if fingerprint:
        return authenticate_certificate(fingerprint)
    return authenticate(authorization)  # no credential at all: the usual 401


async def aauthenticate_request(headers: Mapping[str, str], client_ip: str | None) -> Principal:
    """``authenticate_request`` for the event loop (API keys stay on the async fast path).

    Everything else (OIDC tokens may fetch the provider's JWKS, for up to
    OIDC_HTTP_TIMEOUT_SECONDS) runs on the identity threads, never on the thread-sensitive
    thread that API-key cache misses use: a hanging identity provider delays only its own
    tokens, and at most IDENTITY_THREADS of them at a time.
    """
    authorization = _single(headers, "authorization")
    token = bearer_token(authorization)
    if token and parse_key(token) is not None:
        return await aauthenticate(authorization)
    run = database_sync_to_async(authenticate_request, thread_sensitive=False,
                                 executor=_identity_threads())
    principal: Principal = await run(headers, client_ip)
    return principal


IDENTITY_THREADS = 4
_identity: dict[int, ThreadPoolExecutor] = {}


def _identity_threads() -> ThreadPoolExecutor:
    """This process's identity-provider threads (per pid, as ``_writer``: forks lose threads)."""
    pid = os.getpid()
    with _writers_lock:
        if pid not in _identity:
            _identity.clear()
            _identity[pid] = ThreadPoolExecutor(max_workers=IDENTITY_THREADS,
                                                thread_name_prefix="identity")
        return _identity[pid]


def headers_from_scope(scope: Mapping[str, Any]) -> tuple[dict[str, str], str | None]:
    """(headers, peer address) of an ASGI scope; a repeated header is dropped as ambiguous."""
    seen: dict[str, str] = {}
    repeated: set[str] = set()
    for raw_name, raw_value in scope.get("headers", ()):
        name = raw_name.decode("latin-1").lower()
        if name in seen:
            repeated.add(name)
        seen[name] = raw_value.decode("latin-1")
    # The TCP peer, not a forwarded address: only our proxy itself may vouch for a certificate.
    return {k: v for k, v in seen.items() if k not in repeated}, peer_address(scope)


async def aauthenticate_scope_request(scope: Mapping[str, Any]) -> Principal:
    """What an inference consumer calls to accept API keys, OIDC tokens and mTLS."""
    headers, client_ip = headers_from_scope(scope)
    return await aauthenticate_request(headers, client_ip)
