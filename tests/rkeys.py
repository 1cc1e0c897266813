"""The Redis key layout as tests read it, hash tags included (ADR 0018).

Production code names its keys through ``serving.keys``, ``serving.admission`` and
``metering.keys``; these wrap them for the common test questions ("every usage record", "this
request's stream, whatever its pool").
"""

from __future__ import annotations

from typing import Any

from infra.redis_conn import pool_key, tenant_key
from metering.keys import pending_key, pool_names
from serving.admission import bucket_key, counter_key
from serving.keys import inflight_key, req_key, stream_key, worker_key, workers_key

__all__ = [
    "bucket_key",
    "counter_key",
    "find_req",
    "find_stream",
    "inflight_key",
    "pool_key",
    "pool_names",
    "req_key",
    "served",
    "stream_key",
    "tenant_bucket",
    "tenant_key",
    "usage_raw",
    "usage_records",
    "wait_usage_record",
    "worker_key",
    "workers_key",
]


def served(r: Any, *pools: str, worker_id: str = "test-worker", for_s: float = 600) -> None:
    """Register a worker heartbeat that stays fresh ``for_s`` seconds on each pool, so routing
    counts the pool as served (``serving.availability``) in tests that run no worker."""
    import time

    for pool in pools:
        r.zadd(workers_key(pool), {worker_id: time.time() + for_s})


def tenant_bucket(tenant_id: object, kind: str) -> str:
    """The tenant's own input ("in") or output ("out") token bucket."""
    return bucket_key(tenant_id, "tenant", tenant_id, kind)


def usage_raw(r: Any) -> list[bytes]:
    """Every pool's pending usage records, oldest first within a pool."""
    return [raw for pool in pool_names(r) for raw in r.lrange(pending_key(pool), 0, -1)]


def usage_records(r: Any) -> list[dict[str, Any]]:
    """Every pool's pending usage records, parsed (``usage_raw``'s order)."""
    import json

    return [json.loads(raw) for raw in usage_raw(r)]


def wait_usage_record(r: Any, rid: str, timeout: float = 10.0) -> dict[str, Any]:
    """The usage record of request ``rid``, once it is settled (records are written when the
    request ends, which a live test sees a little after its reply)."""
    from tests import procs

    def find() -> dict[str, Any] | None:
        return next((rec for rec in usage_records(r) if rec["request_id"] == rid), None)

    return procs.wait_until(find, timeout, f"usage record of {rid}")  # type: ignore[return-value]


def _pool_of(r: Any, rid: str) -> str | None:
    return next((p for p in pool_names(r) if r.exists(req_key(p, rid))), None)


def find_req(r: Any, rid: str) -> str:
    """The request's state key in whichever pool holds it (a missing one: the first pool's)."""
    pool = _pool_of(r, rid) or next(iter(pool_names(r)), "")
    return req_key(pool, rid)


def find_stream(r: Any, rid: str) -> str:
    pool = _pool_of(r, rid) or next(iter(pool_names(r)), "")
    return stream_key(pool, rid)
