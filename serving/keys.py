"""The Redis keys of one request, shared by admission, dispatch, the worker and settlement.

Key layout: docs/architecture.md ("Redis keys"). The WFQ dispatcher's per-pool keys are in
``serving.wfq.Keys``.
"""

from __future__ import annotations

from infra.redis_conn import key
from metering.keys import pending_key as usage_pending_key

__all__ = ["deadlines_key", "inflight_key", "req_key", "stream_key", "usage_pending_key"]


def req_key(rid: str) -> str:
    """The request's state hash: tenant, key, pool, charges, state, timestamps."""
    return key("req", rid)


def stream_key(rid: str) -> str:
    """The request's token stream (one entry per engine step, the last one final)."""
    return key("stream", rid)


def deadlines_key() -> str:
    """Every unsettled request by settle-by time: the janitor's backstop."""
    return key("deadlines")


def inflight_key(worker_id: str) -> str:
    """The requests a worker runs; dispatch adds to it in the same script that pops the queue."""
    return key("worker", worker_id, "inflight")
