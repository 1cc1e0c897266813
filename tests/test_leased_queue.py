"""The leased queue on real Redis: only the lease's holder moves, deletes or renews, and every
script goes by EVALSHA."""

from __future__ import annotations

import redis

from infra.leased_queue import Lease, LeasedQueue


def queue(ms: int = 60_000) -> LeasedQueue:
    return LeasedQueue("lq:pending", "lq:processing", "lq:lease", ms)


def lapse_and_take(client: redis.Redis, q: LeasedQueue, ms: int) -> str:
    """The first holder's lease runs out (a long pause) and a second holder takes it."""
    client.delete(q.lease)
    token = Lease(q.lease, ms).acquire(client)
    assert token is not None
    return token


def test_a_holder_whose_lease_lapsed_cannot_renew_the_next_holders_lease(redis_client) -> None:
    q = queue()
    stale = q.acquire(redis_client)
    assert stale is not None
    lapse_and_take(redis_client, q, ms=2_000)
    assert q.extend(redis_client, stale) is False
    # The next holder's lease still runs out on its own schedule, not the stale holder's.
    assert 0 < redis_client.pttl(q.lease) <= 2_000


def test_the_holder_renews_its_own_lease(redis_client) -> None:
    q = queue(ms=60_000)
    token = q.acquire(redis_client)
    assert token is not None
    redis_client.pexpire(q.lease, 1_000)
    assert q.extend(redis_client, token) is True
    assert redis_client.pttl(q.lease) > 50_000


def test_a_stale_holder_can_neither_claim_release_nor_unlock(redis_client) -> None:
    q = queue()
    redis_client.rpush(q.pending, b"a", b"b")
    stale = q.acquire(redis_client)
    assert stale is not None
    fresh = lapse_and_take(redis_client, q, ms=60_000)
    assert q.claim(redis_client, stale, 10) == []
    assert q.claim(redis_client, fresh, 1) == [b"a"]
    assert q.release(redis_client, stale) is False
    assert redis_client.llen(q.processing) == 1
    q.unlock(redis_client, stale)
    assert redis_client.get(q.lease) == fresh.encode()


def test_every_script_runs_by_evalsha(redis_client) -> None:
    q = queue()
    redis_client.rpush(q.pending, b"a")
    redis_client.script_flush()  # the first call must load the body, later ones must not
    redis_client.config_resetstat()
    for _ in range(3):
        token = q.acquire(redis_client)
        assert token is not None
        q.claim(redis_client, token, 10)
        q.extend(redis_client, token)
        q.release(redis_client, token)
        q.unlock(redis_client, token)
    stats = redis_client.info("commandstats")
    assert stats.get("cmdstat_eval", {}).get("calls", 0) == 0
    assert stats["cmdstat_evalsha"]["calls"] >= 15
