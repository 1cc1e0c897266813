"""The facade the HTTP layer uses: submit a tokenized request, read its events, cancel it.

    result = await submit(tenant_id=..., key_id=..., weight=..., model=..., pool=...,
                          prompt_token_ids=ids, sampling=params, limits=limits, stream=True)
    if isinstance(result, Rejection):      # 429: result.headers(), result.too_large
        ...
    async for event in result.events():    # TokenEvent* then FinishEvent | ErrorEvent
        ...
    await result.cancel("client_disconnect")   # on disconnect; idempotent

``submit`` admits in two round trips (``serving.admission``): one Lua script charges every limit
on the tenant's slot, one on the pool's slot stores the transit payload (prompt ids, sampling,
cache salt) in req:{rid} (deleted when a worker claims it; never logged), enqueues it in the
pool's WFQ and wakes an idle worker. ``events`` enforces the time-to-first-token and total
deadlines: on expiry it yields an ``ErrorEvent`` and cancels the sequence. Settlement happens
exactly once wherever the request ends (worker, cancel while queued, janitor).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from infra.redis_conn import get_async_redis
from metering.keys import pool_names_async
from serving import admission, budgets, liveness, settlement, transport, wfq
from serving.admission import AdmissionLimits, Admitted, RateLimitInfo, Reason, Rejected
from serving.keys import req_key
from serving.settlement import Status
from serving.wire import (
    FinishReason,
    SamplingParams,
    pack_prompt,
    pack_sampling,
    text,
    usage_of,
)
from tenants.salts import cache_salt as salt_of

log = logging.getLogger(__name__)

_RID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # 64: metering.UsageRecord.request_id


@dataclass(frozen=True)
class UsageInfo:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenEvent:
    text: str
    token_count: int
    event_id: str  # the stream entry id: send as SSE ``id:`` so a client can resume after it


@dataclass(frozen=True)
class FinishEvent:
    finish_reason: str  # stop | length | abort
    usage: UsageInfo
    event_id: str


@dataclass(frozen=True)
class ErrorEvent:
    code: str  # worker_lost, engine_error, deadline_exceeded, ttft_deadline_exceeded, ...
    message: str
    retryable: bool
    event_id: str | None = None  # None when the gateway made it (deadlines)
    param: str | None = None  # the request parameter an engine's refusal names


Event = TokenEvent | FinishEvent | ErrorEvent

_LIMIT_NAMES = {
    Reason.INPUT_TOKENS: "input tokens per minute",
    Reason.OUTPUT_TOKENS: "output tokens per minute",
    Reason.CONCURRENCY: "concurrent requests",
    Reason.OPEN_STREAMS: "open streams",
}


@dataclass(frozen=True)
class Rejection(Rejected):
    """Admission refused; nothing was charged. The HTTP layer answers 429 with ``headers()``.

    ``admission.Rejected`` (reason, scope, Retry-After, rate-limit headers) plus the message
    the client reads.
    """

    message: str = ""


def _event(entry: transport.StreamEvent) -> list[Event]:
    f = entry.fields
    out: list[Event] = []
    if int(f.get("n", 0) or 0) or f.get("t"):
        out.append(TokenEvent(f.get("t", ""), int(f.get("n", 0) or 0), entry.id))
    if "e" in f:
        out.append(ErrorEvent(f["e"], f.get("m", ""), f.get("r") == "1", entry.id,
                              f.get("p")))
    elif "f" in f:
        u = json.loads(f.get("u") or "{}")
        usage = UsageInfo(int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0)),
                          int(u.get("cached_tokens", 0)))
        out.append(FinishEvent(f["f"], usage, entry.id))
    return out


class Submission:
    """An admitted, queued request. Safe to use from the event loop that created it."""

    def __init__(self, request_id: str, *, pool: str, tenant_id: str, rate_limit: RateLimitInfo,
                 ttft_deadline_s: float, total_deadline_s: float, started: float,
                 shape: str = "") -> None:
        self.request_id = request_id
        self.shape = shape  # how its stream reads (a resume checks it; gateway.inference.choices)
        self.pool = pool
        self.tenant_id = tenant_id
        self.rate_limit = rate_limit
        self.ttft_deadline_s = ttft_deadline_s
        self.total_deadline_s = total_deadline_s
        self._started = started  # time.monotonic() at admission
        self._ended = False
        self._sub: transport.Subscription | None = None

    def first_token_left(self) -> float:
        """Seconds left before the first-token deadline (negative once it passed)."""
        return self._started + self.ttft_deadline_s - time.monotonic()

    def share_deadlines(self, other: Submission) -> None:
        """Run this request's deadlines from ``other``'s admission: a retry of a request
        (gateway.inference.failover) gets no more time than the request had."""
        self._started = other._started
        self.ttft_deadline_s = other.ttft_deadline_s
        self.total_deadline_s = other.total_deadline_s

    def pending(self) -> bool:
        """Whether the next stream entry is already here (the relay then batches its write)."""
        return self._sub is not None and self._sub.ready > 0

    async def events(self, last_event_id: str = "0-0", *,
                     first: str = "The first token") -> AsyncIterator[Event]:
        """Token events, then one FinishEvent or ErrorEvent. Resumable after ``last_event_id``.

        Deadlines run from admission: no token by ``ttft_deadline_s`` or no end by
        ``total_deadline_s`` yields ErrorEvent(ttft_deadline_exceeded | deadline_exceeded) and
        cancels the request (the engine aborts it; the worker bills the tokens it generated).
        ``first`` names what the first deadline waits for in its message (an embeddings
        request has no "first token").
        """
        got_token = last_event_id != "0-0"
        first_by = self._started + self.ttft_deadline_s
        end_by = self._started + self.total_deadline_s
        with transport.open_subscription(self.pool, self.request_id, last_event_id) as sub, \
                liveness.holding(self.pool, self.request_id):
            self._sub = sub
            while True:
                entry = await sub.next_before(end_by if got_token else first_by)
                if entry is None:
                    yield await self._expire(ttft=not got_token, first=first)
                    return
                for event in _event(entry):
                    got_token = got_token or isinstance(event, TokenEvent)
                    yield event
                if entry.terminal:
                    self._ended = True
                    return

    async def _expire(self, *, ttft: bool, first: str) -> ErrorEvent:
        code = "ttft_deadline_exceeded" if ttft else "deadline_exceeded"
        limit = self.ttft_deadline_s if ttft else self.total_deadline_s
        await self.cancel(code)
        what = f"{first} did not arrive" if ttft else "The response did not finish"
        # A first-token timeout is congestion and may pass; a total timeout would recur.
        return ErrorEvent(code, f"{what} within {limit:g} s; the request was cancelled.",
                          retryable=ttft)

    async def cancel(self, reason: str = "client_disconnect") -> None:
        """Stop the request wherever it is; idempotent. Settles it if it was still queued."""
        if not self._ended:
            await cancel_request(self.pool, self.request_id, reason)


async def cancel_request(pool: str, rid: str, reason: str) -> bool:
    """Cancel by id (gateway or janitor). True if a cancel was issued, False if already settled.

    The flag is set first (cancel.lua). A request still in its queue is removed and settled here
    as cancelled with nothing billed (no accelerator work was done); one a worker holds is
    aborted through ``cancel:{pool}`` and the worker settles it with the engine's counts; the
    script publishes that itself (one round trip, cancel.lua C2).
    """
    found = await admission.mark_cancel_async(pool, rid, reason,
                                              channel=transport.cancel_channel(pool))
    if found is None:
        return False
    state, _, tenant = found
    if state == admission.PUBLISHED:
        return True
    if state == "queued" and await wfq.for_loop().remove(pool, tenant, rid):
        await settlement.settle_async(
            pool, rid, status=Status.CANCELLED, finish_reason=FinishReason.ABORT, prompt_tokens=0,
            output_tokens=0, error_code=reason,
            event=transport.finish_event(FinishReason.ABORT, usage_of(0, 0, 0)),
        )
        return True
    await transport.publish_cancel(pool, rid, reason)
    return True


def _message(rejected: Rejected, limits: AdmissionLimits, prompt: int,
             max_out: int, reservation: budgets.Reservation = budgets.NONE) -> str:
    if rejected.reason == Reason.INSUFFICIENT_QUOTA:
        return budgets.refusal_message(reservation.charges[int(rejected.scope) - 1],
                                       rejected.budget_used)
    if rejected.reason == Reason.TOO_LARGE:
        scope, _, kind = rejected.scope.partition(":")
        part = getattr(limits, scope)
        burst, need = (part.buckets()[0][1], prompt) if kind == "input_tokens" else (
            part.buckets()[1][1], max_out)
        what = "input" if kind == "input_tokens" else "output"
        return (f"Request too large: it needs {need} {what} tokens at once, and the {scope}'s "
                f"limit allows at most {burst}. Use a shorter prompt or a smaller max_tokens.")
    if rejected.reason == Reason.DUPLICATE:
        return f"Request id {rejected.request_id!r} is already in use."
    name = _LIMIT_NAMES.get(rejected.reason, rejected.reason)
    return (f"Rate limit reached for {name} ({rejected.scope}). "
            f"Please try again in {rejected.retry_after}s.")


async def submit(
    *, tenant_id: int | str, key_id: int | str | None, weight: float, model: str, pool: str,
    prompt_token_ids: Sequence[int], sampling: SamplingParams, limits: AdmissionLimits,
    stream: bool, request_id: str | None = None, cache_salt: str | None = None,
    priority: int = 0, now: float | None = None, adapter: str | None = None,
    budget_rules: Sequence[budgets.BudgetRule] = (), prices: budgets.UnitPrices | None = None,
    context: Mapping[str, str] | None = None,
) -> Submission | Rejection:
    """Admit and enqueue one tokenized request (see the module docstring).

    ``limits``: ``AdmissionLimits.from_limits(principal.tenant_limits(m), principal.limits(m))``.
    ``cache_salt`` defaults to ``tenants.salts.cache_salt(tenant_id)``.
    ``context``: fields kept in the request's hash for its usage record and trace (the end
    user, the W3C traceparent); never content. ``budget_rules`` are reserved against at ``prices``
    (the model's price now), in the same admission.
    """
    rid = request_id or f"req-{uuid.uuid4().hex}"
    if not _RID.fullmatch(rid):
        raise ValueError("request_id must be 1-64 characters of [A-Za-z0-9_.:-]")
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids is empty")
    if cache_salt is None:
        cache_salt = salt_of(int(tenant_id))
    started = time.monotonic()
    # n choices may each generate max_tokens: all of it is reserved, and settled to what ran.
    prompt, max_out = len(prompt_token_ids), sampling.max_tokens * sampling.n
    reservation = budgets.reserve(tenant_id, budget_rules, prices, prompt, max_out,
                                  time.time() if now is None else now) \
        if budget_rules else budgets.NONE
    result = await admission.admit_async(
        request_id=rid, tenant_id=tenant_id, key_id=key_id, pool=pool, model=model,
        prompt_tokens=prompt, max_output_tokens=max_out, stream=stream, limits=limits, now=now,
        extra={"prompt_ids": pack_prompt(prompt_token_ids), "sampling": pack_sampling(sampling),
               "salt": cache_salt, "weight": repr(float(weight)), "priority": priority,
               "adapter": adapter or "", **(context or {})},
        budgets=reservation,
        queueing=admission.Queueing(weight=weight, kv_tokens=prompt + max_out,
                                    policy=settings.WFQ_POLICY),
    )
    if not isinstance(result, Admitted):
        return Rejection(rid, result.reason, result.scope, result.retry_after, result.rate_limit,
                         result.budget_used,
                         message=_message(result, limits, prompt, max_out, reservation))
    return Submission(rid, pool=pool, tenant_id=str(tenant_id), rate_limit=result.rate_limit,
                      ttft_deadline_s=limits.ttft_deadline_s,
                      total_deadline_s=limits.total_deadline_s, started=started)


async def _find(request_id: str) -> list[Any]:
    """The request's tenant, pool, deadlines and admission time, from whichever pool holds it.

    Its state lives on its pool's slot and a reconnect names only the id, so every known pool
    is asked (one pipelined round trip; pools are few, and a resume is rare).
    """
    r = get_async_redis()
    pools = await pool_names_async(r)
    pipe = r.pipeline(transaction=False)
    for pool in pools:
        pipe.hmget(req_key(pool, request_id), "tenant", "pool", "ttft_s", "total_s",
                   "admitted_at", "shape")
    for values in await pipe.execute() if pools else []:
        if values[0] is not None:
            return list(values)
    return [None] * 6


async def attach(request_id: str, tenant_id: int | str) -> Submission | None:
    """Re-open a request of this tenant (a reconnect with Last-Event-ID); None if unknown.

    The deadlines keep running from the original admission.
    """
    if not _RID.fullmatch(request_id):
        return None
    values = await _find(request_id)
    tenant, pool, ttft, total, admitted, shape = (text(v) if v else None for v in values)
    if tenant is None or tenant != str(tenant_id):
        return None  # another tenant's id reads as unknown (I1)
    t_redis = await get_async_redis().time()
    age = max(0.0, t_redis[0] + t_redis[1] / 1e6 - int(admitted or 0) / 1000)
    return Submission(request_id, pool=pool or "", tenant_id=tenant,
                      rate_limit=RateLimitInfo(-1, -1, -1, -1, 0.0),
                      ttft_deadline_s=float(ttft or 30), total_deadline_s=float(total or 600),
                      started=time.monotonic() - age, shape=shape or "")
