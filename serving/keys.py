"""The Redis keys of one request, shared by admission, dispatch, the worker and settlement.

The builders live in ``infra.keyspace``, the one owner of the layout (docs/architecture.md,
"Redis keys"); this module names the ones a request's life uses. A request's own keys carry its
pool's hash tag (``pool_tag``), like the pool's queues and workers: dispatch (which claims), the
relay step and settlement each touch one slot.
The tenant's admission state (buckets, counters) carries the tenant's tag instead
(``serving.admission``); ADR 0018 says how a request crosses the two.
"""

from __future__ import annotations

from infra.keyspace import (
    deadlines_key,
    inflight_key,
    pools_key,
    req_key,
    stream_key,
    wake_key,
    worker_key,
    workers_key,
)
from metering.keys import pending_key as usage_pending_key

__all__ = [
    "deadlines_key",
    "inflight_key",
    "pools_key",
    "req_key",
    "stream_key",
    "usage_pending_key",
    "wake_key",
    "worker_key",
    "workers_key",
]
