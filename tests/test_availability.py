"""``serving.availability``: a pool can serve while a worker's heartbeat is fresh."""

from __future__ import annotations

import time

from serving import availability
from tests import rkeys
from tests.procs import arun


def test_live_pools_follow_worker_heartbeats(redis_client, settings) -> None:
    settings.WORKER_DEAD_AFTER_SECONDS = 2.0
    availability.forget()
    now = time.time()
    redis_client.zadd(rkeys.workers_key("fresh"), {"w1": now})
    redis_client.zadd(rkeys.workers_key("stale"), {"w2": now - 10})  # missed its heartbeats
    assert arun(availability.live_pools({"fresh", "stale", "never"})) == {"fresh"}
    assert arun(availability.can_serve(["stale", "fresh"]))
    assert not arun(availability.can_serve(["stale", "never"]))
    assert not arun(availability.can_serve([]))
    # A dead verdict is never reused: a worker that just started counts at once.
    redis_client.zadd(rkeys.workers_key("never"), {"w3": time.time()})
    assert arun(availability.can_serve(["never"]))
    # A live verdict is reused for LIVE_TTL_S, then read again.
    redis_client.delete(rkeys.workers_key("fresh"))
    assert arun(availability.can_serve(["fresh"]))
    availability.forget()
    assert not arun(availability.can_serve(["fresh"]))
