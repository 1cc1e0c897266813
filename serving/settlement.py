"""Settlement: refund, release and record a request exactly once, whoever ends it.

``settle`` runs once per request whoever calls it first (worker, gateway, janitor). On the
pool's slot, ``settle.lua`` removes the request from the deadlines backstop and its worker's
in-flight set, pushes exactly one usage record (counts and timings, never text) onto its pool's
``usage:pending`` and corrects its tenant's WFQ tags with the actual cost. The winner then runs
``release.lua`` on the tenant's slot: it refunds the unused output, reconciles the prompt with the
engine's count and releases the slots, once, by taking the admission's release token (ADR 0018).
So settlement is one script per slot, two round trips (ADR 0028); the worker's first one rides
in its last relay step's pipeline.
Why once and in one script: docs/adr/0003-exactly-once-settlement.md. The request's way there
is drawn in ``serving.admission``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from infra.redis_conn import get_async_redis, get_redis
from serving import wfq
from serving.budgets import UnitPrices, settled_amounts
from serving.keys import deadlines_key, req_key, stream_key, usage_pending_key
from serving.lua import script
from serving.wfq import Prices
from serving.wire import text

log = logging.getLogger(__name__)

STREAM_MAXLEN = 10_000  # entries kept per request stream (one per engine step, so plenty)
STREAM_TTL_AFTER_END = 300  # seconds a finished stream stays readable for Last-Event-ID resumes
REQ_TTL_AFTER_END = 300  # seconds a settled req:{rid} stays, so late callers see "settled"


class Status:
    OK = "ok"
    CANCELLED = "cancelled"
    ERROR = "error"
    EXPIRED = "expired"


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
    release_keys: list[str]  # release.lua's keys and arguments: the tenant-side give-back
    release_args: list[Any]
    budget_costs: list[int]  # what the request cost each budget of its reservation (exact)


# -- settle -----------------------------------------------------------------------------------


def settle_call(
    pool: str, rid: str, *, status: str, finish_reason: str | None = None,
    prompt_tokens: int | None = None,
    cached_tokens: int = 0, output_tokens: int | None = None, error_code: str | None = None,
    event: Mapping[str, str | int] | None = None, inflight: str | None = None,
    now: float | None = None, wfq_correction: bool = True,
) -> tuple[list[str], list[Any]]:
    """Keys and arguments of ``settle.lua`` (for callers that queue it on a pipeline).

    ``prompt_tokens=None`` keeps the gateway's count; ``output_tokens=None`` bills the tokens
    delivered to the stream so far (the janitor's case: the engine's count died with it).
    ``event`` is the stream's final entry, written only if this call wins.
    ``wfq_correction=False`` leaves the pool's WFQ tags alone (simulations without a queue).
    """
    queues = wfq.pool_keys(pool)
    prices = Prices.from_settings()
    keys = [*queues.common, req_key(pool, rid), deadlines_key(pool), usage_pending_key(pool),
            stream_key(pool, rid)]
    args: list[Any] = [
        rid, "" if now is None else repr(float(now)), status, finish_reason or "",
        -1 if prompt_tokens is None else prompt_tokens, cached_tokens,
        -1 if output_tokens is None else output_tokens, error_code or "",
        STREAM_MAXLEN, STREAM_TTL_AFTER_END, REQ_TTL_AFTER_END, inflight or "",
        int(wfq_correction), repr(float(prices.input)), repr(float(prices.output)),
        repr(float(prices.kv)), queues.qprefix,
    ]
    for name, value in (event or {}).items():
        args += [name, value]
    return keys, args


def parse_settle(rid: str, raw: list[Any], now: float | None = None) -> Settled | None:
    if text(raw[0]) != "1":
        return None
    vals = [text(v) for v in raw[1:]]
    groups = vals[11:27]  # four buckets: key, delta, rate, burst
    buckets = groups[0::4]
    release_args: list[Any] = [rid, "" if now is None else repr(float(now)), *groups[1::4]]
    for rate, burst in zip(groups[2::4], groups[3::4], strict=True):
        release_args += [rate, burst]
    budget_keys, costs, refunds = _budget_refunds(vals[27:], int(vals[6]), int(vals[7]))
    release_args += [len(budget_keys), *refunds]
    return Settled(
        request_id=rid, record=json.loads(vals[0]), pool=vals[1], tenant_id=vals[2],
        weight=float(vals[3] or 1), charged_prompt=int(vals[4]), charged_output=int(vals[5]),
        prompt_tokens=int(vals[6]), output_tokens=int(vals[7]), dispatched=vals[8] == "1",
        release_keys=[vals[9], vals[10], *buckets, *budget_keys], release_args=release_args,
        budget_costs=costs,
    )


def _budget_refunds(fields: list[str], prompt: int, output: int
                    ) -> tuple[list[str], list[int], list[int]]:
    """(counter keys, exact costs, reservation minus cost) of a settled request's budgets, at
    the prices fixed when it was admitted (serving.budgets)."""
    if len(fields) < 7 or not fields[0]:
        return [], [], []
    keys, metrics, reserved = fields[0].split(), fields[1].split(), fields[2].split()
    prices = UnitPrices("", int(fields[3] or 0), int(fields[4] or 0), int(fields[5] or 0))
    costs = settled_amounts(metrics, prices, prompt, int(fields[6] or 0), output)
    return keys, costs, [int(r) - c for r, c in zip(reserved, costs, strict=True)]


def release(done: Settled, client: redis.Redis | None = None) -> bool:
    """Give the tenant back what the settled request did not use (``release.lua``), once.

    Only the settle winner calls this. If it fails or the process dies first, the token
    expires and the tenant's next admission releases the counters (admit.lua, A5).
    """
    try:
        return bool(script("release").run(client or get_redis(), done.release_keys,
                                          done.release_args))
    except redis.RedisError:
        log.exception("release failed for %s; its token's expiry releases it", done.request_id)
        return False


async def release_async(done: Settled, client: aioredis.Redis | None = None) -> bool:
    try:
        return bool(await script("release").run_async(
            client or get_async_redis(), done.release_keys, done.release_args))
    except redis.RedisError:
        log.exception("release failed for %s; its token's expiry releases it", done.request_id)
        return False


def settle(
    pool: str, rid: str, *, status: str, finish_reason: str | None = None,
    prompt_tokens: int | None = None,
    cached_tokens: int = 0, output_tokens: int | None = None, error_code: str | None = None,
    event: Mapping[str, str | int] | None = None, inflight: str | None = None,
    now: float | None = None, client: redis.Redis | None = None, wfq_correction: bool = True,
) -> bool:
    """Settle exactly once; True for the caller that did it, False for everyone else."""
    keys, args = settle_call(
        pool, rid, status=status, finish_reason=finish_reason, prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens, output_tokens=output_tokens, error_code=error_code,
        event=event, inflight=inflight, now=now, wfq_correction=wfq_correction,
    )
    done = parse_settle(rid, script("settle").run(client or get_redis(), keys, args), now)
    if done:
        release(done, client)
    return done is not None


async def settle_async(
    pool: str, rid: str, *, status: str, finish_reason: str | None = None,
    prompt_tokens: int | None = None,
    cached_tokens: int = 0, output_tokens: int | None = None, error_code: str | None = None,
    event: Mapping[str, str | int] | None = None, inflight: str | None = None,
    now: float | None = None, client: aioredis.Redis | None = None, wfq_correction: bool = True,
) -> bool:
    keys, args = settle_call(
        pool, rid, status=status, finish_reason=finish_reason, prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens, output_tokens=output_tokens, error_code=error_code,
        event=event, inflight=inflight, now=now, wfq_correction=wfq_correction,
    )
    raw = await script("settle").run_async(client or get_async_redis(), keys, args)
    done = parse_settle(rid, raw, now)
    if done:
        await release_async(done, client)
    return done is not None
