"""Request accounting: admit (charge) and settle (refund, release, record), each one Lua script.

The life of a request's charges, between "admitted" and "settled":

    admit ──▶ queued ──claim──▶ running ──▶ settled     (worker: engine usage)
                │                  └──────▶ settled     (cancel, janitor: delivered tokens)
                └─────────────────────────▶ settled     (cancel or deadline while queued)

``admit`` charges the prompt to the tenant's and the key's input buckets, ``max_output_tokens``
to both output buckets, one concurrency slot each and one open stream each, or charges nothing.
``settle`` runs once per request whoever calls it first (worker, gateway, janitor): it refunds
the unused output, reconciles the prompt with the engine's count, releases the slots, removes
the request from the deadlines backstop and its worker's in-flight set, and pushes exactly one
usage record (counts and timings, never text) onto ``usage:pending``. The invariants are written
in ``serving/lua/admit.lua`` and ``settle.lua``; ``tests/test_accounting.py`` tries to break them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis

from infra.redis_conn import get_async_redis, get_redis, key
from serving.lua import script

log = logging.getLogger(__name__)

STREAM_MAXLEN = 10_000  # entries kept per request stream (one per engine step, so plenty)
STREAM_TTL_AFTER_END = 300  # seconds a finished stream stays readable for Last-Event-ID resumes
REQ_TTL_AFTER_END = 300  # seconds a settled req:{rid} stays, so late callers see "settled"
DEADLINE_GRACE_S = 30.0  # the janitor's backstop settles a request this long after its deadline
# Handed to the worker and deleted at claim; the prompt ids are content in transit.
PAYLOAD_FIELDS = ("prompt_ids", "sampling", "salt", "priority", "adapter")


class Status:
    OK = "ok"
    CANCELLED = "cancelled"
    ERROR = "error"
    EXPIRED = "expired"


class Reason:
    """Why an admission was refused (``Rejected.reason``)."""

    TOO_LARGE = "too_large"  # larger than a bucket's burst: can never fit (OpenAI 429 "too large")
    INPUT_TOKENS = "input_tokens"
    OUTPUT_TOKENS = "output_tokens"
    CONCURRENCY = "concurrency"
    OPEN_STREAMS = "open_streams"
    DUPLICATE = "duplicate"  # the request id was already admitted


# -- keys -------------------------------------------------------------------------------------


def req_key(rid: str) -> str:
    return key("req", rid)


def stream_key(rid: str) -> str:
    return key("stream", rid)


def deadlines_key() -> str:
    return key("deadlines")


def usage_pending_key() -> str:
    return key("usage", "pending")


def inflight_key(worker_id: str) -> str:
    return key("worker", worker_id, "inflight")


def _bucket_keys(tenant_id: object, key_id: object) -> list[str]:
    return [
        key("bucket", "tenant", tenant_id, "in"), key("bucket", "tenant", tenant_id, "out"),
        key("bucket", "key", key_id, "in"), key("bucket", "key", key_id, "out"),
    ]


def counter_keys(tenant_id: object, key_id: object) -> list[str]:
    """Concurrency (tenant, key) then open streams (tenant, key)."""
    return [
        key("conc", "tenant", tenant_id), key("conc", "key", key_id),
        key("streams", "tenant", tenant_id), key("streams", "key", key_id),
    ]


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
    """Values for OpenAI's ``x-ratelimit-*`` headers.

    "requests" are concurrent requests (the tightest of tenant and key); "tokens" is the emptiest
    token bucket. ``-1`` means not limited.
    """

    limit_requests: int
    remaining_requests: int
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_s: float

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

    @property
    def too_large(self) -> bool:
        return self.reason == Reason.TOO_LARGE

    def headers(self) -> dict[str, str]:
        out = self.rate_limit.headers()
        if self.retry_after > 0:
            out["retry-after"] = str(self.retry_after)
        return out


@dataclass(frozen=True)
class Settled:
    """What the winning settle call learned; ``record`` is the usage record it pushed."""

    request_id: str
    record: dict[str, Any]
    pool: str
    tenant_id: str
    weight: float
    charged_prompt: int
    charged_output: int
    prompt_tokens: int
    output_tokens: int
    dispatched: bool


# -- admit ------------------------------------------------------------------------------------


def _admit_call(
    *, request_id: str, tenant_id: object, key_id: object, pool: str, model: str,
    prompt_tokens: int, max_output_tokens: int, stream: bool, limits: AdmissionLimits,
    now: float | None, extra: Mapping[str, str | bytes | int | float] | None,
) -> tuple[list[str], list[Any]]:
    if prompt_tokens < 0 or max_output_tokens < 0:
        raise ValueError("token counts cannot be negative")
    keys = [req_key(request_id), deadlines_key(), *_bucket_keys(tenant_id, key_id),
            *counter_keys(tenant_id, key_id)]
    buckets = [*limits.tenant.buckets(), *limits.key.buckets()]
    args: list[Any] = [
        request_id, "" if now is None else repr(float(now)), prompt_tokens, max_output_tokens,
        int(stream), limits.total_deadline_s + DEADLINE_GRACE_S,
    ]
    for rate, burst in buckets:
        args += [rate, burst]
    args += [limits.tenant.concurrent_requests or 0, limits.key.concurrent_requests or 0,
             limits.tenant.open_streams or 0, limits.key.open_streams or 0]
    fields: dict[str, Any] = {
        "tenant": tenant_id, "key": "" if key_id is None else key_id, "pool": pool, "model": model,
        "ttft_s": limits.ttft_deadline_s, "total_s": limits.total_deadline_s,
    }
    fields.update(extra or {})
    for name, value in fields.items():
        args += [name, value]
    return keys, args


def _s(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _parse_admit(request_id: str, raw: list[Any]) -> Admitted | Rejected:
    ok, reason, scope, retry, lreq, rreq, ltok, rtok, reset = (_s(v) for v in raw)
    info = RateLimitInfo(int(lreq), int(rreq), int(ltok), int(rtok), float(reset))
    if ok == "1":
        return Admitted(request_id, info)
    return Rejected(request_id, reason, scope, int(retry), info)


def admit(
    *, request_id: str, tenant_id: object, key_id: object, pool: str, model: str,
    prompt_tokens: int, max_output_tokens: int, stream: bool, limits: AdmissionLimits,
    now: float | None = None, extra: Mapping[str, Any] | None = None,
    client: redis.Redis | None = None,
) -> Admitted | Rejected:
    """Charge every limit of one request or none (``serving/lua/admit.lua``).

    ``now`` overrides Redis TIME (virtual-time simulations); ``extra`` fields go into req:{rid}.
    """
    keys, args = _admit_call(
        request_id=request_id, tenant_id=tenant_id, key_id=key_id, pool=pool, model=model,
        prompt_tokens=prompt_tokens, max_output_tokens=max_output_tokens, stream=stream,
        limits=limits, now=now, extra=extra,
    )
    raw = script("admit").run(client or get_redis(), keys, args)
    return _parse_admit(request_id, raw)


async def admit_async(
    *, request_id: str, tenant_id: object, key_id: object, pool: str, model: str,
    prompt_tokens: int, max_output_tokens: int, stream: bool, limits: AdmissionLimits,
    now: float | None = None, extra: Mapping[str, Any] | None = None,
    client: aioredis.Redis | None = None,
) -> Admitted | Rejected:
    keys, args = _admit_call(
        request_id=request_id, tenant_id=tenant_id, key_id=key_id, pool=pool, model=model,
        prompt_tokens=prompt_tokens, max_output_tokens=max_output_tokens, stream=stream,
        limits=limits, now=now, extra=extra,
    )
    raw = await script("admit").run_async(client or get_async_redis(), keys, args)
    return _parse_admit(request_id, raw)


# -- settle -----------------------------------------------------------------------------------


def settle_call(
    rid: str, *, status: str, finish_reason: str | None = None, prompt_tokens: int | None = None,
    cached_tokens: int = 0, output_tokens: int | None = None, error_code: str | None = None,
    event: Mapping[str, str | int] | None = None, inflight: str | None = None,
    now: float | None = None,
) -> tuple[list[str], list[Any]]:
    """Keys and arguments of ``settle.lua`` (for callers that queue it on a pipeline).

    ``prompt_tokens=None`` keeps the gateway's count; ``output_tokens=None`` bills the tokens
    delivered to the stream so far (the janitor's case: the engine's count died with it).
    ``event`` is the stream's final entry, written only if this call wins.
    """
    keys = [req_key(rid), deadlines_key(), usage_pending_key(), stream_key(rid)]
    args: list[Any] = [
        rid, "" if now is None else repr(float(now)), status, finish_reason or "",
        -1 if prompt_tokens is None else prompt_tokens, cached_tokens,
        -1 if output_tokens is None else output_tokens, error_code or "",
        STREAM_MAXLEN, STREAM_TTL_AFTER_END, REQ_TTL_AFTER_END, inflight or "",
    ]
    for name, value in (event or {}).items():
        args += [name, value]
    return keys, args


def parse_settle(rid: str, raw: list[Any]) -> Settled | None:
    if _s(raw[0]) != "1":
        return None
    vals = [_s(v) for v in raw[1:]]
    return Settled(
        request_id=rid, record=json.loads(vals[0]), pool=vals[1], tenant_id=vals[2],
        weight=float(vals[3] or 1), charged_prompt=int(vals[4]), charged_output=int(vals[5]),
        prompt_tokens=int(vals[6]), output_tokens=int(vals[7]), dispatched=vals[8] == "1",
    )


def wfq_costs(done: Settled) -> tuple[float, float]:
    """(estimated, actual) WFQ cost of a settled request, at the dispatcher's prices."""
    from serving.wfq import Prices

    prices = Prices.from_settings()
    return (prices.cost(done.charged_prompt, done.charged_output),
            prices.cost(done.prompt_tokens, done.output_tokens))


_async_wfqs: dict[int, tuple[asyncio.AbstractEventLoop, Any]] = {}


def _async_wfq() -> Any:
    """This event loop's ``AsyncWfq`` (its client is bound to the loop)."""
    from serving.wfq import AsyncWfq

    loop = asyncio.get_running_loop()
    found = _async_wfqs.get(id(loop))
    if found is None or found[0] is not loop:  # ids of closed loops get reused
        found = _async_wfqs[id(loop)] = (loop, AsyncWfq())
    return found[1]


def correct_wfq(done: Settled) -> None:
    """Correct the tenant's finish tag with the actual cost; only the settle winner calls this.

    Safe as a separate call: the settle script already made this request's accounting final, and
    the correction only moves the tenant's last tag (its future requests' tags). Exactly once
    follows from settle's once (the caller must be the winner), which is why no request id is
    passed to ``complete``. If the process dies between the two calls, the tenant keeps the
    estimate's tag: a fairness skew bounded by one request. A request removed from its queue
    before dispatch gets no correction: ``wfq.remove`` already gave its whole cost back.
    """
    from serving import wfq

    if not done.dispatched:
        return
    estimated, actual = wfq_costs(done)
    try:
        wfq.complete(done.pool, done.tenant_id, estimated_cost=estimated, actual_cost=actual,
                     weight=done.weight)
    except Exception:  # fairness bookkeeping must never fail a settlement that already happened
        log.exception("wfq.complete failed for %s", done.request_id)


async def correct_wfq_async(done: Settled) -> None:
    if not done.dispatched:
        return
    estimated, actual = wfq_costs(done)
    try:
        await _async_wfq().complete(done.pool, done.tenant_id, estimated_cost=estimated,
                                    actual_cost=actual, weight=done.weight)
    except Exception:
        log.exception("wfq.complete failed for %s", done.request_id)


def settle(
    rid: str, *, status: str, finish_reason: str | None = None, prompt_tokens: int | None = None,
    cached_tokens: int = 0, output_tokens: int | None = None, error_code: str | None = None,
    event: Mapping[str, str | int] | None = None, inflight: str | None = None,
    now: float | None = None, client: redis.Redis | None = None, wfq_correction: bool = True,
) -> bool:
    """Settle exactly once; True for the caller that did it, False for everyone else."""
    keys, args = settle_call(
        rid, status=status, finish_reason=finish_reason, prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens, output_tokens=output_tokens, error_code=error_code,
        event=event, inflight=inflight, now=now,
    )
    done = parse_settle(rid, script("settle").run(client or get_redis(), keys, args))
    if done and wfq_correction:
        correct_wfq(done)
    return done is not None


async def settle_async(
    rid: str, *, status: str, finish_reason: str | None = None, prompt_tokens: int | None = None,
    cached_tokens: int = 0, output_tokens: int | None = None, error_code: str | None = None,
    event: Mapping[str, str | int] | None = None, inflight: str | None = None,
    now: float | None = None, client: aioredis.Redis | None = None, wfq_correction: bool = True,
) -> bool:
    keys, args = settle_call(
        rid, status=status, finish_reason=finish_reason, prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens, output_tokens=output_tokens, error_code=error_code,
        event=event, inflight=inflight, now=now,
    )
    raw = await script("settle").run_async(client or get_async_redis(), keys, args)
    done = parse_settle(rid, raw)
    if done and wfq_correction:
        await correct_wfq_async(done)
    return done is not None


# -- claim and cancel -------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    request_id: str
    cancel_reason: str  # '' unless a cancel arrived before the worker took it
    payload: dict[str, bytes]


async def claim_async(
    rid: str, worker_id: str, *, client: aioredis.Redis | None = None
) -> Claim | None:
    """Take a dispatched request: queued -> running, handing over and deleting its payload."""
    raw = await script("claim").run_async(
        client or get_async_redis(), [req_key(rid)],
        [worker_id, inflight_key(worker_id), "", *PAYLOAD_FIELDS],
    )
    if _s(raw[0]) != "1":
        return None
    return Claim(rid, _s(raw[1]), dict(zip(PAYLOAD_FIELDS, raw[2:], strict=True)))


def _parse_cancel(raw: list[Any]) -> tuple[str, str, str] | None:
    if _s(raw[0]) != "1":
        return None
    return _s(raw[1]), _s(raw[2]), _s(raw[3])


def mark_cancel(
    rid: str, reason: str, client: redis.Redis | None = None
) -> tuple[str, str, str] | None:
    """Flag req:{rid} cancelled; (state, pool, tenant) or None if nothing is left to cancel."""
    return _parse_cancel(script("cancel").run(client or get_redis(), [req_key(rid)], [reason]))


async def mark_cancel_async(
    rid: str, reason: str, client: aioredis.Redis | None = None
) -> tuple[str, str, str] | None:
    raw = await script("cancel").run_async(client or get_async_redis(), [req_key(rid)], [reason])
    return _parse_cancel(raw)


def retry_after_seconds(needed: float, level: float, rate_per_min: float) -> int:
    """The Retry-After admit.lua computes, for documentation and tests: ceil, at least 1."""
    return max(1, math.ceil((needed - level) * 60 / rate_per_min))
