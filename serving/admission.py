"""Request accounting: admit (charge on the tenant's slot, enter on the pool's) and cancel;
settlement (refund, release, record) is ``serving.settlement``.

The life of a request's charges, between "admitted" and "settled":

    admit ──▶ queued ──dispatch──▶ running ──▶ settled  (worker: engine usage)
                │                     └──────▶ settled  (cancel, janitor: delivered tokens)
                └────────────────────────────▶ settled  (cancel or deadline while queued)

``admit`` charges the prompt to the tenant's and the key's input buckets, ``max_output_tokens``
to both output buckets, one concurrency slot each and one open stream each, or charges nothing.
The dispatcher hands a request and its payload to one worker in the step that pops it
(``serving/lua/wfq/dispatch.lua``, K1, K2); ``cancel`` flags it so whoever holds it ends it.
The invariants are written in ``serving/lua/admit.lua``, ``enter.lua``, ``settle.lua`` and
``release.lua``; ``tests/test_accounting.py`` tries to break them.

Two slots (ADR 0018): a tenant's buckets and counters (and its keys') carry the tenant's hash
tag, a request's state carries its pool's. So admission is two atomic steps: ``admit.lua``
charges on the tenant's slot and leaves a release token, then ``enter.lua`` writes the request,
queues it and wakes a worker on the pool's slot (ADR 0028); settlement is ``settle.lua`` on the
pool's slot, then ``release.lua`` on the tenant's, which gives back only while it can take the
token. A process that dies between two steps leaves a token that expires, and the tenant's next
admission releases its counters.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis

from infra.keyspace import bucket_key as bucket_key  # re-exported (serving.cells, tests)
from infra.keyspace import charges_keys
from infra.keyspace import counter_key as counter_key  # re-exported
from infra.redis_conn import get_async_redis, get_redis
from serving import wfq
from serving.budgets import NONE, Reservation
from serving.keys import deadlines_key, pools_key, req_key, wake_key
from serving.lua import script
from serving.wire import text

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


# -- keys (built in infra.keyspace) ----------------------------------------------------------


def _bucket_keys(tenant_id: object, key_id: object) -> list[str]:
    return [bucket_key(tenant_id, scope, key_id, kind)
            for scope in ("tenant", "key") for kind in ("in", "out")]


def counter_keys(tenant_id: object, key_id: object) -> list[str]:
    """Concurrency (tenant, key) then open streams (tenant, key)."""
    return [counter_key(name, tenant_id, scope, key_id)
            for name in ("conc", "streams") for scope in ("tenant", "key")]


def token_keys(tenant_id: object) -> list[str]:
    """The tenant's release tokens (zset) and what each releases (hash): admit.lua, release.lua."""
    return charges_keys(tenant_id)


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
    """The two steps of an admission: charge (tenant's slot), then enter (pool's slot)."""

    charge_keys: list[str]
    charge_args: list[Any]
    enter_keys: list[str]
    enter_args: list[Any]
    pool: str
    budgets: Reservation = NONE


@dataclass(frozen=True)
class Queueing:
    """How the request waits in its pool's WFQ: its tenant's weight and its dispatch size.

    ``prices`` and ``sizes`` (prompt, output tokens) override the WFQ cost's defaults (the
    settings' prices, the admission's counts): simulations that tag differently from what they
    charge.
    """

    weight: float = 1.0
    kv_tokens: int = 0  # KV the dispatcher reserves for it (prompt + max output)
    policy: str = "wfq"
    prices: wfq.Prices | None = None
    sizes: tuple[int, int] | None = None


def _admit_call(
    *, request_id: str, tenant_id: object, key_id: object, pool: str, model: str,
    prompt_tokens: int, max_output_tokens: int, stream: bool, limits: AdmissionLimits,
    now: float | None, extra: Mapping[str, str | bytes | int | float] | None,
    budgets: Reservation = NONE, queueing: Queueing | None = None,
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
    queueing = queueing or Queueing()
    prompt, output = queueing.sizes or (prompt_tokens, max_output_tokens)
    queue_keys, queue_args = wfq.enqueue_call(
        pool, queueing.policy, str(tenant_id), request_id, weight=queueing.weight,
        prompt_tokens=prompt, max_output_tokens=output, kv_tokens=queueing.kv_tokens,
        now=now, prices=queueing.prices)
    enter_args: list[Any] = [request_id, when, backstop, *queue_args]
    for name, value in fields.items():
        enter_args += [name, value]
    return _AdmitCalls([*tokens, *buckets, *counter_keys(tenant_id, key_id),
                        *(c.key for c in budgets.charges)], args,
                       [*queue_keys, req_key(pool, request_id), deadlines_key(pool),
                        wake_key(pool)], enter_args, pool, budgets)


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
    """release.lua giving back every charge of an admission whose pool-slot step refused it."""
    c = calls.charge_args
    amounts = [c[2], c[3], c[2], c[3]]
    charges = calls.budgets.charges
    return ([*calls.charge_keys[:6], *(b.key for b in charges)],
            [c[0], c[1], *amounts, *c[6:14], len(charges), *(b.amount for b in charges)])


# The pools this process admitted to: ``pools`` (which the janitor and the usage writer walk,
# and every worker's heartbeat writes) is on no slot of the request's, so admission adds the
# pool once per process, and again when enter.lua reports the pool's first request since its
# state was created (a new or flushed Redis): never on the way of every request.
_pools_joined: set[str] = set()


async def _join_pools(r: aioredis.Redis, pool: str, seq: int) -> None:
    if seq == 1 or pool not in _pools_joined:
        await r.sadd(pools_key(), pool)
        _pools_joined.add(pool)


async def admit_async(
    *, request_id: str, tenant_id: object, key_id: object, pool: str, model: str,
    prompt_tokens: int, max_output_tokens: int, stream: bool, limits: AdmissionLimits,
    now: float | None = None, extra: Mapping[str, Any] | None = None,
    client: aioredis.Redis | None = None, budgets: Reservation = NONE,
    queueing: Queueing | None = None,
) -> Admitted | Rejected:
    """Charge every limit and budget of one request or none (``serving/lua/admit.lua``, the
    tenant's slot), then write, queue and announce it (``enter.lua``, the pool's slot): two
    round trips, or three when the second step refuses (the charge is given back) or the pool
    must join ``pools``.

    ``now`` overrides Redis TIME (virtual-time simulations); ``extra`` fields go into req;
    ``budgets`` is the request's reservation (``serving.budgets.reserve``); ``queueing`` its
    place in the pool's WFQ. Raises ``wfq.DuplicateRequest`` or ``wfq.PolicyMismatch`` (after
    giving the charge back) when the queue refuses the id.
    """
    calls = _admit_call(
        request_id=request_id, tenant_id=tenant_id, key_id=key_id, pool=pool, model=model,
        prompt_tokens=prompt_tokens, max_output_tokens=max_output_tokens, stream=stream,
        limits=limits, now=now, extra=extra, budgets=budgets, queueing=queueing or Queueing(),
    )
    r = client or get_async_redis()
    raw = await script("admit").run_async(r, calls.charge_keys, calls.charge_args)
    result = _parse_admit(request_id, raw, budgets)
    if not isinstance(result, Admitted):
        return result
    try:
        entered = await script("enter").run_async(r, calls.enter_keys, calls.enter_args)
    except BaseException as exc:
        # Not queued, so nobody else will end it: give the charge back now.
        await script("release").run_async(r, *_unwind_args(calls))
        if isinstance(exc, redis.ResponseError):
            wfq.raise_script_error(exc)
        raise
    if text(entered[0]) != "1":
        await script("release").run_async(r, *_unwind_args(calls))
        return _duplicate(request_id)
    await _join_pools(r, pool, int(entered[2]))
    return result


# -- claim and cancel -------------------------------------------------------------------------


def _parse_cancel(raw: list[Any]) -> tuple[str, str, str] | None:
    if text(raw[0]) != "1":
        return None
    return text(raw[1]), text(raw[2]), text(raw[3])


PUBLISHED = "published"  # mark_cancel_async's state when cancel.lua told the workers itself


def mark_cancel(
    pool: str, rid: str, reason: str, client: redis.Redis | None = None
) -> tuple[str, str, str] | None:
    """Flag req:{rid} cancelled; (state, pool, tenant) or None if nothing is left to cancel."""
    return _parse_cancel(script("cancel").run(client or get_redis(), [req_key(pool, rid)],
                                              [reason, "", rid]))


async def mark_cancel_async(
    pool: str, rid: str, reason: str, client: aioredis.Redis | None = None, *,
    channel: str = "",
) -> tuple[str, str, str] | None:
    """``mark_cancel``; with ``channel`` (the pool's cancel channel) the script also tells the
    workers of a request that is no longer queued (cancel.lua C2): the state it returns is
    then "published" for such a request, so the caller does not publish again."""
    raw = await script("cancel").run_async(client or get_async_redis(), [req_key(pool, rid)],
                                           [reason, channel, rid])
    found = _parse_cancel(raw)
    if found is not None and len(raw) > 4 and text(raw[4]) == "1":
        return PUBLISHED, found[1], found[2]
    return found


def retry_after_seconds(needed: float, level: float, rate_per_min: float) -> int:
    """The Retry-After admit.lua computes, for documentation and tests: ceil, at least 1."""
    return max(1, math.ceil((needed - level) * 60 / rate_per_min))
