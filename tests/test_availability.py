"""``serving.availability``: a pool can serve while a worker's heartbeat is fresh."""

from __future__ import annotations

import time

import pytest

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


@pytest.mark.django_db(transaction=True)  # the catalog is read from another thread
def test_routing_refuses_a_model_no_live_worker_serves(redis_client) -> None:
    from gateway.inference import pools
    from gateway.inference.errors import ApiError
    from tests.factories import make_model, make_pool

    make_pool(make_model("unserved"), name="unserved-pool")
    pools.forget_catalog()
    try:
        with pytest.raises(ApiError) as err:
            arun(pools.choose_pool("unserved", 1, "local", frozenset()))
        assert (err.value.status, err.value.code) == (503, "model_not_served")
        assert "`unserved`" in err.value.message and err.value.headers["retry-after"] == "5"
        assert arun(pools.visible_models(1, "local", frozenset())) == []
        # A resumed stream replays what Redis holds: it needs no live worker.
        resumed = arun(pools.choose_pool("unserved", 1, "local", frozenset(),
                                         served_only=False))
        assert resumed.name == "unserved-pool"
        rkeys.served(redis_client, "unserved-pool")
        assert arun(pools.choose_pool("unserved", 1, "local", frozenset())).name == \
            "unserved-pool"
        assert [m.name for m in arun(pools.visible_models(1, "local", frozenset()))] == [
            "unserved"]
    finally:
        pools.forget_catalog()
