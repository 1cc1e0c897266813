"""Settlement: refund, release and record a request exactly once, whoever ends it.

``settle`` runs once per request whoever calls it first (worker, gateway, janitor): it refunds
the unused output, reconciles the prompt with the engine's count, releases the slots, removes
the request from the deadlines backstop and its worker's in-flight set, and pushes exactly one
usage record (counts and timings, never text) onto ``usage:pending``, all in ``settle.lua``.
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
    if text(raw[0]) != "1":
        return None
    vals = [text(v) for v in raw[1:]]
    return Settled(
        request_id=rid, record=json.loads(vals[0]), pool=vals[1], tenant_id=vals[2],
        weight=float(vals[3] or 1), charged_prompt=int(vals[4]), charged_output=int(vals[5]),
        prompt_tokens=int(vals[6]), output_tokens=int(vals[7]), dispatched=vals[8] == "1",
    )


def wfq_costs(done: Settled) -> tuple[float, float]:
    """(estimated, actual) WFQ cost of a settled request, at the dispatcher's prices."""
    prices = Prices.from_settings()
    return (prices.cost(done.charged_prompt, done.charged_output),
            prices.cost(done.prompt_tokens, done.output_tokens))


def correct_wfq(done: Settled) -> None:
    """Correct the tenant's finish tag with the actual cost; only the settle winner calls this.

    Safe as a separate call: the settle script already made this request's accounting final, and
    the correction only moves the tenant's last tag (its future requests' tags). Exactly once
    follows from settle's once (the caller must be the winner), which is why no request id is
    passed to ``complete``. If the process dies between the two calls, the tenant keeps the
    estimate's tag: a fairness skew bounded by one request. A request removed from its queue
    before dispatch gets no correction: ``wfq.remove`` already gave its whole cost back.
    """
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
        await wfq.for_loop().complete(done.pool, done.tenant_id, estimated_cost=estimated,
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
