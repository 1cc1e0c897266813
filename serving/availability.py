"""Can a pool serve now: which pools have a live worker, read from worker heartbeats.

The pool table says what an operator configured; only a running worker serves. A worker is
live while its heartbeat (``workers:{pool}``, written by ``heartbeat.lua`` every
``WORKER_HEARTBEAT_SECONDS``) is younger than ``WORKER_DEAD_AFTER_SECONDS``, the same rule the
janitor reaps by. The gateway lists a model in ``/v1/models`` only while one of its pools is
live, and refuses a request for a model with no live pool at once (a retryable 503) instead of
queueing it until its first-token deadline. Routing builds on ``live_pools``.

A just-killed worker still counts as live until its heartbeat ages out, so a request sent in
that gap queues for its restarted successor, as before. Nothing here writes.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from django.conf import settings

from infra.redis_conn import get_async_redis
from serving.keys import workers_key

# A live verdict is reused this long per process, so the hot path pays no round trip per
# request; a dead one is never reused, so a worker that just started is seen at once.
LIVE_TTL_S = 1.0
_live_at: dict[str, float] = {}


async def live_pools(pools: Collection[str]) -> frozenset[str]:
    """The pools among ``pools`` that at least one live worker serves now (one pipelined
    round trip for those not seen live within ``LIVE_TTL_S``)."""
    now = time.monotonic()
    live = {p for p in pools if now - _live_at.get(p, -LIVE_TTL_S) < LIVE_TTL_S}
    ask = sorted(set(pools) - live)
    if ask:
        cutoff = time.time() - settings.WORKER_DEAD_AFTER_SECONDS
        pipe = get_async_redis().pipeline(transaction=False)
        for pool in ask:
            pipe.zcount(workers_key(pool), cutoff, "+inf")
        for pool, count in zip(ask, await pipe.execute(), strict=True):
            if int(count):
                live.add(pool)
                _live_at[pool] = now
            else:
                _live_at.pop(pool, None)
    return frozenset(live)


async def can_serve(pools: Collection[str]) -> bool:
    """Whether any of these pools (a model's pools) can serve a request now."""
    return bool(pools) and bool(await live_pools(pools))


def forget() -> None:
    """Drop the cached verdicts (tests)."""
    _live_at.clear()
