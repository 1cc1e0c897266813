"""The janitor: ends requests nobody else will end. Runs in every worker; callable anywhere.

Two sweeps, each made only of atomic, idempotent steps, so any number of janitors (one per
worker, the gateway, a Celery beat task) can run at the same time:

1. Dead workers. A worker whose heartbeat in ``workers:{pool}`` is older than
   ``WORKER_DEAD_AFTER_SECONDS`` is marked reaped (``reap_mark.lua``: atomic with the heartbeat,
   so a worker that beat in time is never reaped and a reaped one never beats again under that
   id). Each request in its in-flight set then gets a retryable ``worker_lost`` error as its
   stream's last entry and is settled for the tokens actually delivered, both in the one
   ``settle.lua`` call that wins; the worker is forgotten once its in-flight set is empty.
2. Dead gateways (``serving.liveness``). A gateway process whose heartbeat in ``gateways`` is
   older than ``GATEWAY_DEAD_AFTER_SECONDS`` is claimed by exactly one janitor (``ZREM``) and
   each request it was relaying, unless a live gateway relays it now (a resumed stream), is
   cancelled with reason ``gateway_lost``: nobody is left to read it.
A live worker's in-flight set is its own to keep true: it settles members it does not run
(``workers.host.EngineHost._reconcile``, with ``fail_lost_request_async``).
Pools are walked through ``pools``: a request's keys and its ``deadlines`` entry live on its
pool's slot (ADR 0018).

3. Overdue requests. Any request still unsettled past its ``deadlines`` score (admission + total
   deadline + grace: the gateway that held it is gone, or nobody settled it) is flagged, removed
   from its queue if still queued, settled as ``expired`` with a non-retryable
   ``deadline_exceeded`` error, and a cancel is published in case a live worker still runs it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings

from infra.redis_conn import get_redis
from metering.keys import pool_names
from serving import liveness, transport, wfq
from serving.admission import mark_cancel
from serving.keys import deadlines_key, inflight_key, worker_key, workers_key
from serving.lua import script
from serving.settlement import Status, settle, settle_async
from serving.wire import FinishReason, text, usage_of

log = logging.getLogger(__name__)

REAPED_MARK_TTL_S = 24 * 3600
OVERDUE_BATCH = 200


@dataclass
class SweepReport:
    dead_workers: list[str] = field(default_factory=list)
    orphaned_requests: list[str] = field(default_factory=list)  # cancelled: gateway gone
    lost_requests: list[str] = field(default_factory=list)  # settled by this sweep
    expired_requests: list[str] = field(default_factory=list)  # settled by this sweep

    def as_dict(self) -> dict[str, list[str]]:
        return {"dead_workers": self.dead_workers, "lost_requests": self.lost_requests,
                "orphaned_requests": self.orphaned_requests,
                "expired_requests": self.expired_requests}


def _redis_now(r: redis.Redis) -> float:
    secs, micros = r.time()
    return float(secs) + micros / 1e6


def sweep(client: redis.Redis | None = None, *, now: float | None = None) -> SweepReport:
    r = client or get_redis()
    report = SweepReport()
    reap_dead_workers(r, report)
    reap_dead_gateways(r, report)
    settle_overdue(r, report, now=now)
    if (report.dead_workers or report.lost_requests or report.expired_requests
            or report.orphaned_requests):
        log.warning("janitor: %s", report.as_dict())
    return report


def reap_dead_workers(r: redis.Redis, report: SweepReport | None = None) -> SweepReport:
    report = report or SweepReport()
    cutoff = _redis_now(r) - settings.WORKER_DEAD_AFTER_SECONDS
    for pool in pool_names(r):
        for raw_wid in r.zrangebyscore(workers_key(pool), "-inf", cutoff):
            wid = text(raw_wid)
            if reap_worker(r, pool, wid, report):
                report.dead_workers.append(wid)
    return report


def reap_worker(r: redis.Redis, pool: str, wid: str, report: SweepReport) -> bool:
    """Fail and settle every request of a dead worker; True once the worker is forgotten."""
    marked = script("reap_mark").run(
        r, [workers_key(pool), worker_key(pool, wid, "reaped")],
        [wid, settings.WORKER_DEAD_AFTER_SECONDS, REAPED_MARK_TTL_S],
    )
    if not marked:
        return False  # it beat in time after all
    inflight = inflight_key(pool, wid)
    for raw in r.smembers(inflight):
        rid = text(raw)
        if fail_lost_request(r, pool, rid, inflight):
            report.lost_requests.append(rid)
        r.srem(inflight, rid)  # settled now or before (or its state expired): not in flight
    done = script("reap_finish").run(
        r, [workers_key(pool), inflight, worker_key(pool, wid, "load")], [wid])
    return bool(done)


def _lost(inflight: str) -> dict[str, Any]:
    """How a request nobody runs any more ends: a retryable error, billed for what was
    delivered (its stream's count: the engine's own count is gone with the run)."""
    return {"status": Status.ERROR, "finish_reason": None, "prompt_tokens": None,
            "output_tokens": None, "error_code": "worker_lost", "inflight": inflight,
            "event": transport.error_event(
                "worker_lost", "The model server handling this request stopped; please retry.",
                retryable=True)}


def fail_lost_request(r: redis.Redis, pool: str, rid: str, inflight: str) -> bool:
    """End a request whose worker died (see _lost); True if this call settled it."""
    return settle(pool, rid, client=r, **_lost(inflight))


async def fail_lost_request_async(r: aioredis.Redis, pool: str, rid: str, inflight: str) -> bool:
    """The same, for a live worker's strays (workers.host, EngineHost._reconcile)."""
    return await settle_async(pool, rid, client=r, **_lost(inflight))


def reap_dead_gateways(r: redis.Redis, report: SweepReport | None = None) -> SweepReport:
    report = report or SweepReport()
    cutoff = _redis_now(r) - settings.GATEWAY_DEAD_AFTER_SECONDS
    for raw_gid in r.zrangebyscore(liveness.gateways_key(), "-inf", cutoff):
        gid = text(raw_gid)
        if not r.zrem(liveness.gateways_key(), gid):
            continue  # another janitor claimed it
        live = [text(g) for g in r.zrange(liveness.gateways_key(), 0, -1)]
        for raw in r.smembers(liveness.rids_key(gid)):
            held = text(raw)
            if any(r.sismember(liveness.rids_key(g), held) for g in live):
                continue  # resumed on a live gateway
            pool, rid = liveness.parse_member(held)
            if cancel_orphan(r, pool, rid):
                report.orphaned_requests.append(rid)
        r.delete(liveness.rids_key(gid))
    return report


def cancel_orphan(r: redis.Redis, pool: str, rid: str) -> bool:
    """Cancel a request nobody reads any more, as a client hang-up would (see submission)."""
    found = mark_cancel(pool, rid, "gateway_lost", client=r)
    if found is None:
        return False  # already settled
    state, _, tenant = found
    if state == "queued" and wfq.Wfq(r).remove(pool, tenant, rid):
        return settle(
            pool, rid, status=Status.CANCELLED, finish_reason=FinishReason.ABORT, prompt_tokens=0,
            output_tokens=0, error_code="gateway_lost", client=r,
            event=transport.finish_event(FinishReason.ABORT, usage_of(0, 0, 0)))
    transport.publish_cancel_sync(pool, rid, "gateway_lost")
    return True


def settle_overdue(r: redis.Redis, report: SweepReport | None = None, *,
                   now: float | None = None) -> SweepReport:
    report = report or SweepReport()
    cutoff = _redis_now(r) if now is None else now
    for pool in pool_names(r):
        for raw in r.zrangebyscore(deadlines_key(pool), "-inf", cutoff, start=0,
                                   num=OVERDUE_BATCH):
            rid = text(raw)
            if expire_request(r, pool, rid, now=now):
                report.expired_requests.append(rid)
    return report


def expire_request(r: redis.Redis, pool: str, rid: str, *, now: float | None = None) -> bool:
    found = mark_cancel(pool, rid, "deadline_exceeded", client=r)
    if found is None:  # settled (or its state is gone): only the zset entry is left
        r.zrem(deadlines_key(pool), rid)
        return False
    state, _, tenant = found
    removed = state == "queued" and wfq.Wfq(r).remove(pool, tenant, rid)
    won = settle(
        pool, rid, status=Status.EXPIRED, prompt_tokens=0 if removed else None,
        output_tokens=0 if removed else None, error_code="deadline_exceeded", now=now, client=r,
        event=transport.error_event(
            "deadline_exceeded", "The request passed its deadline and was cancelled.",
            retryable=False),
    )
    if not removed:
        transport.publish_cancel_sync(pool, rid, "deadline_exceeded")
    return won
