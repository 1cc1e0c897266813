"""The response cache's store on real Redis (serving/response_cache.py, cache_store.lua R1-R2):
entries per tenant only, at most RESPONSE_CACHE_MAX_ENTRIES live per tenant even under
concurrent stores, a TTL on every entry, oversized answers not stored. The HTTP side (opt-in,
determinism, SSE shape of a hit, metering, isolation on real processes):
tests/test_routes_live.py::test_the_response_cache_is_per_tenant_and_its_hits_are_metered."""

from __future__ import annotations

import threading

from serving import response_cache
from serving.response_cache import Entry, entry_key, index_key
from tests.procs import arun


def entry(text: str = "hello") -> Entry:
    return Entry("m", "p", [text], "stop", 3, 1)


def test_a_tenant_reads_only_its_own_entries(redis_client, settings):
    arun(response_cache.put(1, "d", entry("one's")))
    assert arun(response_cache.get(1, "d")).pieces == ["one's"]
    assert arun(response_cache.get(2, "d")) is None
    assert "{t.1}" in entry_key(1, "d") and "{t.1}" in index_key(1)
    ttl = redis_client.ttl(entry_key(1, "d"))
    assert 0 < ttl <= settings.RESPONSE_CACHE_TTL_SECONDS


def test_concurrent_stores_never_leave_more_than_the_bound(redis_client, settings):
    settings.RESPONSE_CACHE_MAX_ENTRIES = 5
    arun(response_cache.put(2, "other", entry()))  # another tenant's, never trimmed by tenant 1

    def store(worker: int) -> None:
        for i in range(20):
            arun(response_cache.put(1, f"{worker}-{i}", entry()))

    threads = [threading.Thread(target=store, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    listed = {k.decode() for k in redis_client.zrange(index_key(1), 0, -1)}
    live = {k.decode() for k in redis_client.keys(entry_key(1, "*"))}
    assert len(listed) == 5 and live == listed  # R2: the index and the entries agree
    assert arun(response_cache.get(2, "other")) is not None


def test_an_answer_over_the_size_bound_is_not_stored(redis_client, settings):
    settings.RESPONSE_CACHE_MAX_ENTRY_BYTES = 1024
    assert not arun(response_cache.put(1, "big", entry("x" * 2000)))
    assert arun(response_cache.get(1, "big")) is None
