"""The Redis keys of one request, shared by admission, dispatch, the worker and settlement.

Key layout: docs/architecture.md ("Redis keys"). The WFQ dispatcher's per-pool keys are in
``serving.wfq.Keys``. A request's own keys carry its pool's hash tag (``pool_tag``), like the
pool's queues and workers: dispatch, claim, the relay step and settlement each touch one slot.
The tenant's admission state (buckets, counters) carries the tenant's tag instead
(``serving.admission``); ADR 0018 says how a request crosses the two.
"""

from __future__ import annotations

from infra.pool_workers import workers_key
from infra.redis_conn import pool_key
from metering.keys import pending_key as usage_pending_key
from metering.keys import pools_key

__all__ = [
    "deadlines_key",
    "inflight_key",
    "pools_key",
    "req_key",
    "stream_key",
    "usage_pending_key",
    "worker_key",
    "workers_key",
]


def req_key(pool: str, rid: str) -> str:
    """The request's state hash: tenant, key, pool, charges, state, timestamps."""
    return pool_key("req", pool, rid)


def stream_key(pool: str, rid: str) -> str:
    """The request's token stream (one entry per engine step, the last one final)."""
    return pool_key("stream", pool, rid)


def deadlines_key(pool: str) -> str:
    """The pool's unsettled requests by settle-by time: the janitor's backstop."""
    return pool_key("deadlines", pool)


def worker_key(pool: str, worker_id: str, part: str) -> str:
    """One of a worker's keys (``inflight``, ``load``, ``reaped``), on its pool's slot."""
    return pool_key("worker", pool, worker_id, part)


def inflight_key(pool: str, worker_id: str) -> str:
    """The requests a worker runs; dispatch adds to it in the same script that pops the queue."""
    return worker_key(pool, worker_id, "inflight")
