"""Request accounting: admit (charge), claim and cancel, each one Lua script; settlement
(refund, release, record) is ``serving.settlement``.

The life of a request's charges, between "admitted" and "settled":

    admit ──▶ queued ──claim──▶ running ──▶ settled     (worker: engine usage)
                │                  └──────▶ settled     (cancel, janitor: delivered tokens)
                └─────────────────────────▶ settled     (cancel or deadline while queued)

``admit`` charges the prompt to the tenant's and the key's input buckets, ``max_output_tokens``
to both output buckets, one concurrency slot each and one open stream each, or charges nothing.
``claim`` hands a dispatched request and its payload to one worker; ``cancel`` flags it so
whoever holds it ends it. The invariants are written in ``serving/lua/admit.lua``,
``open.lua``, ``settle.lua`` and ``release.lua``; ``tests/test_accounting.py`` tries to break
them.

Two slots (ADR 0018): a tenant's buckets and counters (and its keys') carry the tenant's hash
tag, a request's state carries its pool's. So admission is two atomic steps: ``admit.lua``
charges on the tenant's slot and leaves a release token, then ``open.lua`` writes the request
on the pool's slot; settlement is ``settle.lua`` on the pool's slot, then ``release.lua`` on
the tenant's, which gives back only while it can take the token. A process that dies between
two steps leaves a token that expires, and the tenant's next admission releases its counters.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis

from infra.redis_conn import get_async_redis, get_redis, tenant_key
from serving.budgets import NONE, Reservation
from serving.keys import deadlines_key, inflight_key, pools_key, req_key
from serving.lua import script
from serving.wire import PAYLOAD_FIELDS, text

log = logging.getLogger(__name__)

DEADLINE_GRACE_S = 30.0  # the janitor's backstop settles a request this long after its deadline
# A release token outlives the janitor's backstop by this much, so the backstop's release comes
# first and admit.lua's prune of an expired token is only for a process that died mid-way.
RELEASE_TOKEN_GRACE_S = 120.0


class Reason:
    """Why an admission was refused (``Rejected.reason``)."""

    TOO_LARGE = "too_large"  # larger than a bucket's burst: can never fit (OpenAI 429 "too large")
    INPUT_TOKENS = "input_tokens"
    OUTPUT_TOKENS = "output_tokens"
    CONCURRENCY = "concurrency"
    OPEN_STREAMS = "open_streams"
    DUPLICATE = "duplicate"  # the request id was already admitted
    INSUFFICIENT_QUOTA = "insufficient_quota"  # a budget cannot hold the reservation (OpenAI)


# -- keys -------------------------------------------------------------------------------------


def bucket_key(tenant_id: object, scope: str, ident: object, kind: str) -> str:
    """A token bucket (``kind`` "in" or "out") of the tenant (``scope`` "tenant") or of one of
    its keys (``scope`` "key", ``ident`` the key's id), on the tenant's slot."""
    if scope == "tenant":
        return tenant_key("bucket", tenant_id, "tenant", kind)
    return tenant_key("bucket", tenant_id, "key", ident, kind)


def counter_key(name: str, tenant_id: object, scope: str = "tenant", ident: object = None) -> str:
    """A ``conc`` or ``streams`` counter of the tenant or one of its keys, on the tenant's slot."""
    if scope == "tenant":
        return tenant_key(name, tenant_id, "tenant")
    return tenant_key(name, tenant_id, "key", ident)


def _bucket_keys(tenant_id: object, key_id: object) -> list[str]:
    return [bucket_key(tenant_id, scope, key_id, kind)
            for scope in ("tenant", "key") for kind in ("in", "out")]


def counter_keys(tenant_id: object, key_id: object) -> list[str]:
    """Concurrency (tenant, key) then open streams (tenant, key)."""
    return [counter_key(name, tenant_id, scope, key_id)
            for name in ("conc", "streams") for scope in ("tenant", "key")]


def token_keys(tenant_id: object) -> list[str]:
    """The tenant's release tokens (zset) and what each releases (hash): admit.lua, release.lua."""
    return [tenant_key("charges", tenant_id), tenant_key("charges", tenant_id, "what")]


# -- limits -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScopeLimits:
    """One scope's limits (a tenant, or one of its keys). ``None`` means not limited here.

    A burst of ``None`` is one minute's worth of the rate, as in ``tenants.models``.
    """

    input_tpm: int | None = None
    output_tpm: int | None = None
    input_burst: int | None = None
    output_burst: int | None = None
    concurrent_requests: int | None = None
    open_streams: int | None = None

    def buckets(self) -> list[tuple[int, int]]:
        """(rate per minute, burst) for the input then the output bucket; (0, 0) = unlimited."""
        return [
            (self.input_tpm or 0, self.input_burst or self.input_tpm or 0),
            (self.output_tpm or 0, self.output_burst or self.output_tpm or 0),
        ]


@dataclass(frozen=True)
class AdmissionLimits:
    tenant: ScopeLimits
    key: ScopeLimits = field(default_factory=ScopeLimits)
    ttft_deadline_s: float = 30.0
    total_deadline_s: float = 600.0

    @classmethod
    def from_limits(cls, tenant: Any, key: Any = None) -> AdmissionLimits:
        """From ``tenants.limits.Limits``: the tenant's own, and the key's effective (capped).

        The deadlines are the key's effective ones when given, else the tenant's.
        """
        names = ScopeLimits.__dataclass_fields__
        effective = key if key is not None else tenant
        return cls(
            tenant=ScopeLimits(**{n: getattr(tenant, n, None) for n in names}),
            key=ScopeLimits(**{n: getattr(key, n, None) for n in names})
            if key is not None else ScopeLimits(),
            ttft_deadline_s=float(getattr(effective, "ttft_deadline_s", None) or 30.0),
            total_deadline_s=float(getattr(effective, "total_deadline_s", None) or 600.0),
        )


# -- results ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RateLimitInfo:
    """Values for OpenAI's ``x-ratelimit-*`` headers, stating the reservation rule.

    "requests" are concurrent requests (the tightest of tenant and key); "tokens" is the emptiest
    token bucket. ``-1`` means not limited. A request reserves its whole possible size before it
    runs: ``prompt`` tokens from the input buckets and ``n x max_tokens`` from the output ones.
    So ``remaining_tokens`` is the bucket's level *after* this request's reservation when it
    was admitted (the unused part comes back when it ends), and the level now when it was
    refused; ``reserved_tokens`` (``x-ratelimit-reserved-tokens``) is what this request takes
    from that bucket. A client paces itself by sending while its next request's reservation
    (prompt + n x max_tokens) is at most ``remaining_tokens``: a refusal always has
    ``reserved_tokens > remaining_tokens``.
    """

    limit_requests: int
    remaining_requests: int
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_s: float
    reserved_tokens: int = -1

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.limit_requests >= 0:
            out["x-ratelimit-limit-requests"] = str(self.limit_requests)
            out["x-ratelimit-remaining-requests"] = str(self.remaining_requests)
            out["x-ratelimit-reset-requests"] = "0s"
        if self.limit_tokens >= 0:
            out["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            out["x-ratelimit-remaining-tokens"] = str(self.remaining_tokens)
            out["x-ratelimit-reset-tokens"] = f"{round(self.reset_tokens_s, 3):g}s"
            if self.reserved_tokens >= 0:
                out["x-ratelimit-reserved-tokens"] = str(self.reserved_tokens)
        return out


@dataclass(frozen=True)
class Admitted:
    request_id: str
    rate_limit: RateLimitInfo


@dataclass(frozen=True)
class Rejected:
    request_id: str
    reason: str  # a ``Reason``
    scope: str  # "tenant" or "key" (with ":input_tokens"/":output_tokens" for too_large)
    retry_after: int  # seconds; 0 when waiting cannot help (too_large, duplicate)
    rate_limit: RateLimitInfo
    budget_used: int = 0  # insufficient_quota: the refusing budget's spend (scope: its index)

    @property
    def too_large(self) -> bool:
        return self.reason == Reason.TOO_LARGE

    def headers(self) -> dict[str, str]:
        out = self.rate_limit.headers()
        if self.retry_after > 0:
            out["retry-after"] = str(self.retry_after)
        return out


# -- admit ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _AdmitCalls:
    """The two steps of an admission: charge (tenant's slot), then open (pool's slot)."""

    charge_keys: list[str]
    charge_args: list[Any]
    open_keys: list[str]
    open_args: list[Any]
    pool: str
    budgets: Reservation = NONE


def _admit_call(
    *, request_id: str, tenant_id: object, key_id: object, pool: str, model: str,
    prompt_tokens: int, max_output_tokens: int, stream: bool, limits: AdmissionLimits,
    now: float | None, extra: Mapping[str, str | bytes | int | float] | None,
    budgets: Reservation = NONE,
) -> _AdmitCalls:
    if prompt_tokens < 0 or max_output_tokens < 0:
        raise ValueError("token counts cannot be negative")
    buckets, tokens = _bucket_keys(tenant_id, key_id), token_keys(tenant_id)
    rates = [*limits.tenant.buckets(), *limits.key.buckets()]
    when = "" if now is None else repr(float(now))
    backstop = limits.total_deadline_s + DEADLINE_GRACE_S
    args: list[Any] = [request_id, when, prompt_tokens, max_output_tokens, int(stream),
                       backstop + RELEASE_TOKEN_GRACE_S]
    for rate, burst in rates:
        args += [rate, burst]
    args += [limits.tenant.concurrent_requests or 0, limits.key.concurrent_requests or 0,
             limits.tenant.open_streams or 0, limits.key.open_streams or 0,
             *budgets.admit_args()]
    fields: dict[str, Any] = {
        "p": prompt_tokens, "o": max_output_tokens, "stream": int(stream),
        "tk": tokens[0], "tw": tokens[1],
        "tenant": tenant_id, "key": "" if key_id is None else key_id, "pool": pool, "model": model,
        "ttft_s": limits.ttft_deadline_s, "total_s": limits.total_deadline_s,
    }
    for i, (bucket, (rate, burst)) in enumerate(zip(buckets, rates, strict=True), start=1):
        fields.update({f"b{i}": bucket, f"r{i}": rate, f"x{i}": burst})
    fields.update(budgets.req_fields())
    fields.update(extra or {})
    open_args: list[Any] = [request_id, when, backstop]
    for name, value in fields.items():
        open_args += [name, value]
    return _AdmitCalls([*tokens, *buckets, *counter_keys(tenant_id, key_id),
                        *(c.key for c in budgets.charges)], args,
                       [req_key(pool, request_id), deadlines_key(pool)], open_args, pool, budgets)


def _parse_admit(request_id: str, raw: list[Any], budgets: Reservation = NONE
                 ) -> Admitted | Rejected:
    ok, reason, scope, retry, lreq, rreq, ltok, rtok, reset, *rest = (text(v) for v in raw)
    info = RateLimitInfo(int(lreq), int(rreq), int(ltok), int(rtok), float(reset),
                         int(rest[0]) if rest else -1)
    if ok == "1":
        return Admitted(request_id, info)
    if reason == Reason.INSUFFICIENT_QUOTA:  # wait until the refusing budget's period ends
        charge = budgets.charges[int(scope) - 1]
        return Rejected(request_id, reason, scope, charge.reset_s, info, int(rest[1]))
    return Rejected(request_id, reason, scope, int(retry), info)


def _duplicate(request_id: str) -> Rejected:
    return Rejected(request_id, Reason.DUPLICATE, "", 0, RateLimitInfo(-1, -1, -1, -1, 0.0))


def _unwind_args(calls: _AdmitCalls) -> tuple[list[str], list[Any]]:
    """release.lua giving back every charge of an admission whose open step refused the id."""
    c = calls.charge_args
    amounts = [c[2], c[3], c[2], c[3]]
    charges = calls.budgets.charges
    return ([*calls.charge_keys[:6], *(b.key for b in charges)],
            [c[0], c[1], *amounts, *c[6:14], len(charges), *(b.amount for b in charges)])


def admit(
    *, request_id: str, tenant_id: object, key_id: object, pool: str, model: str,
    prompt_tokens: int, max_output_tokens: int, stream: bool, limits: AdmissionLimits,
    now: float | None = None, extra: Mapping[str, Any] | None = None,
    client: redis.Redis | None = None,
) -> Admitted | Rejected:
    """Charge every limit of one request or none (``serving/lua/admit.lua``), then write the
    request on its pool's slot (``open.lua``).

    ``now`` overrides Redis TIME (virtual-time simulations); ``extra`` fields go into req.
    """
    calls = _admit_call(
        request_id=request_id, tenant_id=tenant_id, key_id=key_id, pool=pool, model=model,
        prompt_tokens=prompt_tokens, max_output_tokens=max_output_tokens, stream=stream,
        limits=limits, now=now, extra=extra,
    )
    r = client or get_redis()
    result = _parse_admit(request_id, script("admit").run(r, calls.charge_keys,
                                                          calls.charge_args))
    if not isinstance(result, Admitted):
        return result
    r.sadd(pools_key(), pool)  # before the pool's first key: the janitor walks the pools
    if not script("open").run(r, calls.open_keys, calls.open_args):
        script("release").run(r, *_unwind_args(calls))
        return _duplicate(request_id)
    return result


async def admit_async(
    *, request_id: str, tenant_id: object, key_id: object, pool: str, model: str,
    prompt_tokens: int, max_output_tokens: int, stream: bool, limits: AdmissionLimits,
    now: float | None = None, extra: Mapping[str, Any] | None = None,
    client: aioredis.Redis | None = None, budgets: Reservation = NONE,
) -> Admitted | Rejected:
    """Charge every limit and budget of one request or none (``serving/lua/admit.lua``), then
    write the request on its pool's slot (``open.lua``).

    ``now`` overrides Redis TIME (virtual-time simulations); ``extra`` fields go into req;
    ``budgets`` is the request's reservation (``serving.budgets.reserve``).
    """
    calls = _admit_call(
        request_id=request_id, tenant_id=tenant_id, key_id=key_id, pool=pool, model=model,
        prompt_tokens=prompt_tokens, max_output_tokens=max_output_tokens, stream=stream,
        limits=limits, now=now, extra=extra, budgets=budgets,
    )
    r = client or get_async_redis()
    raw = await script("admit").run_async(r, calls.charge_keys, calls.charge_args)
    result = _parse_admit(request_id, raw, budgets)
    if not isinstance(result, Admitted):
        return result
    # The pool joins ``pools`` (the janitor and the usage writer walk it) alongside open, on
    # another connection, so it adds no wait; either lands before their next pass.
    opened, _ = await asyncio.gather(script("open").run_async(r, calls.open_keys, calls.open_args),
                                     r.sadd(pools_key(), pool))
    if not opened:
        await script("release").run_async(r, *_unwind_args(calls))
        return _duplicate(request_id)
    return result


# -- claim and cancel -------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    request_id: str
    cancel_reason: str  # '' unless a cancel arrived before the worker took it
    payload: dict[str, bytes]


async def claim_async(
    pool: str, rid: str, worker_id: str, *, client: aioredis.Redis | None = None
) -> Claim | None:
    """Take a dispatched request: queued -> running, handing over and deleting its payload."""
    raw = await script("claim").run_async(
        client or get_async_redis(), [req_key(pool, rid)],
        [worker_id, inflight_key(pool, worker_id), "", *PAYLOAD_FIELDS],
    )
    if text(raw[0]) != "1":
        return None
    return Claim(rid, text(raw[1]), dict(zip(PAYLOAD_FIELDS, raw[2:], strict=True)))


def _parse_cancel(raw: list[Any]) -> tuple[str, str, str] | None:
    if text(raw[0]) != "1":
        return None
    return text(raw[1]), text(raw[2]), text(raw[3])


def mark_cancel(
    pool: str, rid: str, reason: str, client: redis.Redis | None = None
) -> tuple[str, str, str] | None:
    """Flag req:{rid} cancelled; (state, pool, tenant) or None if nothing is left to cancel."""
    return _parse_cancel(script("cancel").run(client or get_redis(), [req_key(pool, rid)],
                                              [reason]))


async def mark_cancel_async(
    pool: str, rid: str, reason: str, client: aioredis.Redis | None = None
) -> tuple[str, str, str] | None:
    raw = await script("cancel").run_async(client or get_async_redis(), [req_key(pool, rid)],
                                           [reason])
    return _parse_cancel(raw)


def retry_after_seconds(needed: float, level: float, rate_per_min: float) -> int:
    """The Retry-After admit.lua computes, for documentation and tests: ceil, at least 1."""
    return max(1, math.ceil((needed - level) * 60 / rate_per_min))
