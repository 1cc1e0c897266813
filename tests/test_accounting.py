"""Admit and settle on real Redis: the invariants of serving/lua/admit.lua and settle.lua.

A1 bucket levels stay within [0, burst]; A2 a rejected admission charges nothing; A3 counters
never exceed their limits; S1 settlement happens once; S2 one usage record per settled request;
S3 counters return to zero. The tests race threads and processes against the scripts.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import random
import threading
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from infra.redis_conn import get_redis, key, new_redis, redis_url
from serving import admission as acc
from serving import settlement
from serving.admission import AdmissionLimits, Admitted, Reason, Rejected, ScopeLimits
from serving.keys import deadlines_key, req_key, stream_key, usage_pending_key
from serving.lua import script
from tests.procs import arun

# Run on one Redis and again on a real Redis Cluster (tests/conftest.py redis_topology): every
# script's keys must stay in one slot.
pytestmark = pytest.mark.redis_topologies("single", "cluster")

T0 = 1_000_000.0  # virtual time: no refill happens unless a test moves it


def limits(**tenant: int) -> AdmissionLimits:
    base = dict(input_tpm=6000, output_tpm=600, concurrent_requests=10, open_streams=5)
    base.update(tenant)
    return AdmissionLimits(tenant=ScopeLimits(**base), total_deadline_s=60)


def admit_call(rid: str, lim: AdmissionLimits, *, prompt: int = 100, out: int = 50,
               stream: bool = True, tenant: int = 1, key_id: int = 11, now: float = T0,
               client: aioredis.Redis | None = None) -> Coroutine[Any, Any, Admitted | Rejected]:
    """The gateway's admission (admit.lua, then enter.lua), as production calls it."""
    return acc.admit_async(request_id=rid, tenant_id=tenant, key_id=key_id, pool="p", model="m",
                           prompt_tokens=prompt, max_output_tokens=out, stream=stream,
                           limits=lim, now=now, client=client)


def admit(rid: str, lim: AdmissionLimits, **kw: Any) -> Admitted | Rejected:
    return arun(admit_call(rid, lim, **kw))


def level(r: redis.Redis, scope: str, ident: int, kind: str, tenant: int = 1) -> float:
    """A bucket's level: the tenant's (ident = the tenant) or key ident's of ``tenant``."""
    owner = ident if scope == "tenant" else tenant
    value = r.hget(acc.bucket_key(owner, scope, ident, kind), "level")
    return float(value) if value is not None else math.nan


def counter(r: redis.Redis, name: str, scope: str, ident: int, tenant: int = 1) -> int:
    owner = ident if scope == "tenant" else tenant
    return int(r.get(acc.counter_key(name, owner, scope, ident)) or 0)


def snapshot(r: redis.Redis) -> dict[bytes, object]:
    out: dict[bytes, object] = {}
    for k in sorted(r.keys("*")):
        kind = r.type(k)
        out[k] = r.hgetall(k) if kind == b"hash" else r.zrange(k, 0, -1, withscores=True) \
            if kind == b"zset" else r.get(k) if kind == b"string" else kind
    return out


def test_admit_charges_every_bucket_and_counter(redis_client):
    lim = AdmissionLimits(
        tenant=ScopeLimits(input_tpm=6000, output_tpm=600, concurrent_requests=4, open_streams=2),
        key=ScopeLimits(input_tpm=3000, output_tpm=300, concurrent_requests=2, open_streams=1),
        total_deadline_s=60,
    )
    result = admit("r1", lim, prompt=100, out=50)
    assert isinstance(result, Admitted)
    assert level(redis_client, "tenant", 1, "in") == 5900
    assert level(redis_client, "tenant", 1, "out") == 550
    assert level(redis_client, "key", 11, "in") == 2900
    assert level(redis_client, "key", 11, "out") == 250
    for name in ("conc", "streams"):
        assert counter(redis_client, name, "tenant", 1) == 1
        assert counter(redis_client, name, "key", 11) == 1
    state = redis_client.hgetall(req_key("p", "r1"))
    assert state[b"state"] == b"queued" and state[b"p"] == b"100" and state[b"o"] == b"50"
    assert state[b"tenant"] == b"1" and state[b"key"] == b"11" and state[b"pool"] == b"p"
    assert redis_client.zscore(deadlines_key("p"), "r1") == pytest.approx(
        T0 + 60 + acc.DEADLINE_GRACE_S)
    # Headers: the key's concurrency (2) is tightest; the key's output bucket is emptiest.
    info = result.rate_limit
    assert (info.limit_requests, info.remaining_requests) == (2, 1)
    assert (info.limit_tokens, info.remaining_tokens) == (300, 250)
    assert info.reset_tokens_s == pytest.approx(10.0)
    assert info.headers()["x-ratelimit-remaining-tokens"] == "250"


@pytest.mark.parametrize(
    ("first", "second", "reason"),
    [
        (dict(prompt=5000, out=10), dict(prompt=1500, out=10), Reason.INPUT_TOKENS),
        (dict(prompt=10, out=580), dict(prompt=10, out=30), Reason.OUTPUT_TOKENS),
    ],
)
def test_rejection_charges_nothing_and_says_when(redis_client, first, second, reason):
    lim = limits()
    assert isinstance(admit("a", lim, **first), Admitted)
    before = snapshot(redis_client)
    result = admit("b", lim, **second)
    assert isinstance(result, Rejected) and result.reason == reason
    assert snapshot(redis_client) == before  # A2: nothing written, not even req:b
    # Retry-After: seconds until the lacking bucket refills enough, rounded up.
    rate = 6000 if reason == Reason.INPUT_TOKENS else 600
    have = 1000 if reason == Reason.INPUT_TOKENS else 20
    need = second["prompt"] if reason == Reason.INPUT_TOKENS else second["out"]
    assert result.retry_after == math.ceil((need - have) * 60 / rate)
    # ...and it is honest: one second earlier still fails, at that time it fits.
    assert isinstance(admit("b", lim, now=T0 + result.retry_after - 1, **second), Rejected)
    assert isinstance(admit("b", lim, now=T0 + result.retry_after, **second), Admitted)


def test_concurrency_and_stream_limits(redis_client):
    lim = limits(concurrent_requests=2, open_streams=1)
    assert isinstance(admit("s1", lim, stream=True), Admitted)
    refused = admit("s2", lim, stream=True)
    assert isinstance(refused, Rejected) and refused.reason == Reason.OPEN_STREAMS
    assert isinstance(admit("n1", lim, stream=False), Admitted)
    refused = admit("n2", lim, stream=False)
    assert isinstance(refused, Rejected) and refused.reason == Reason.CONCURRENCY
    assert refused.retry_after >= 1 and refused.headers()["retry-after"] == "1"
    assert settlement.settle("p", "s1", status="ok", output_tokens=1, now=T0)
    assert isinstance(admit("s3", lim, stream=True), Admitted)


def test_too_large_is_distinct_and_never_fits(redis_client):
    lim = limits(output_tpm=600, output_burst=700)
    result = admit("big", lim, out=701, now=T0 + 10_000)  # a full bucket does not help
    assert isinstance(result, Rejected) and result.too_large
    assert result.scope == "tenant:output_tokens" and result.retry_after == 0
    assert "retry-after" not in result.headers()
    assert redis_client.keys("*") == []
    assert isinstance(admit("fits", lim, out=700), Admitted)  # the burst, not the rate, bounds


def test_duplicate_request_id_is_refused_and_charges_nothing(redis_client):
    lim = limits()
    assert isinstance(admit("same", lim), Admitted)
    before = snapshot(redis_client)
    result = admit("same", lim)
    assert isinstance(result, Rejected) and result.reason == Reason.DUPLICATE
    assert snapshot(redis_client) == before


def test_buckets_refill_continuously_up_to_burst(redis_client):
    lim = limits(input_tpm=600, input_burst=1000)
    assert isinstance(admit("a", lim, prompt=1000, out=1), Admitted)
    assert level(redis_client, "tenant", 1, "in") == 0
    # 10 tokens a second: 30 s later there is room for 300 but not for 301.
    assert isinstance(admit("b", lim, prompt=301, out=1, now=T0 + 30), Rejected)
    assert isinstance(admit("b", lim, prompt=300, out=1, now=T0 + 30), Admitted)
    # An hour later the bucket holds its burst, not an hour of tokens.
    assert isinstance(admit("c", lim, prompt=1, out=1, now=T0 + 3600), Admitted)
    assert level(redis_client, "tenant", 1, "in") == 999


def test_settle_refunds_unused_output_and_corrects_input(redis_client):
    lim = limits()
    admit("r", lim, prompt=100, out=50)
    assert settlement.settle("p", "r", status="ok", finish_reason="stop", prompt_tokens=120,
                      cached_tokens=64, output_tokens=20, now=T0, wfq_correction=False)
    # The engine's counts win: 20 more input tokens charged, 30 output tokens refunded.
    assert level(redis_client, "tenant", 1, "in") == 6000 - 120
    assert level(redis_client, "tenant", 1, "out") == 600 - 20
    for name in ("conc", "streams"):
        assert counter(redis_client, name, "tenant", 1) == 0
        assert counter(redis_client, name, "key", 11) == 0
    assert redis_client.zcard(deadlines_key("p")) == 0
    [raw] = redis_client.lrange(usage_pending_key("p"), 0, -1)
    record = json.loads(raw)
    assert record["prompt_tokens"] == 120 and record["cached_tokens"] == 64
    assert record["completion_tokens"] == 20 and record["status"] == "ok"
    assert record["tenant_id"] == 1 and record["key_id"] == 11 and record["model"] == "m"


def test_refund_is_capped_at_burst(redis_client):
    lim = limits(output_tpm=600)
    admit("r", lim, out=500)
    # 10 minutes later the bucket has refilled to its burst; the refund cannot push it over.
    assert settlement.settle("p", "r", status="ok", output_tokens=0, now=T0 + 600,
                             wfq_correction=False)
    assert level(redis_client, "tenant", 1, "out") == 600


def test_usage_record_carries_counts_never_content(redis_client):
    admit("r", limits())
    settlement.settle("p", "r", status="ok", finish_reason="length", output_tokens=50, now=T0 + 2,
               event={"f": "length", "u": "{}"}, wfq_correction=False)
    record = json.loads(redis_client.lpop(usage_pending_key("p")))
    assert set(record) == {
        "request_id", "tenant_id", "key_id", "model", "pool", "end_user", "prompt_tokens",
        "cached_tokens",
        "completion_tokens", "queue_wait_ms", "ttft_ms", "total_ms", "status", "finish_reason",
        "error_code", "stream", "admitted_at_ms", "dispatched_at_ms", "first_token_at_ms",
        "settled_at_ms", "project_id",  # ids for the request log, not content
    }
    assert record["total_ms"] == 2000
    assert [e[1] for e in redis_client.xrange(stream_key("p", "r"))] == [{b"f": b"length",
                                                                          b"u": b"{}"}]


def test_settle_twice_settles_once(redis_client):
    admit("r", limits())
    assert settlement.settle("p", "r", status="ok", output_tokens=10, now=T0, wfq_correction=False)
    before = snapshot(redis_client)
    assert not settlement.settle("p", "r", status="error", output_tokens=0, now=T0,
                                 event={"e": "x"},
                          wfq_correction=False)
    assert snapshot(redis_client) == before
    assert not settlement.settle("p", "unknown", status="ok", now=T0)


def test_concurrent_settles_settle_once(redis_client):
    for i in range(20):
        assert isinstance(admit(f"r{i}", limits(concurrent_requests=100), out=10, stream=False),
                          Admitted)
    barrier = threading.Barrier(8)

    def settle_all(worker: int) -> int:
        client = new_redis()
        barrier.wait()
        return sum(settlement.settle("p", f"r{i}", status="ok", output_tokens=worker % 5,
                                     client=client,
                              wfq_correction=False) for i in range(20))

    with ThreadPoolExecutor(8) as pool:
        wins = sum(pool.map(settle_all, range(8)))
    assert wins == 20
    assert redis_client.llen(usage_pending_key("p")) == 20
    assert counter(redis_client, "conc", "tenant", 1) == 0


def _admit_many(url: str, worker: int, n: int, out: list[int] | None = None) -> int:
    lim = limits(output_tpm=600, concurrent_requests=1000, open_streams=1000)

    async def many() -> int:
        client = aioredis.Redis.from_url(url)  # this thread's loop's own connections
        won = 0
        try:
            for i in range(n):
                result = await admit_call(f"w{worker}-{i}", lim, prompt=1, out=7, client=client)
                won += isinstance(result, Admitted)
        finally:
            await client.aclose()
        return won

    won = asyncio.run(many())
    if out is not None:
        out.append(won)
    return won


def _admit_process(url: str, worker: int, n: int, results: mp.Queue) -> None:
    results.put(_admit_many(url, worker, n))


@pytest.mark.redis_topologies("single")  # statistics of arithmetic that slots do not change
def test_concurrent_admits_never_over_admit(redis_client):
    """Threads and processes race for 600 output tokens at 7 a request: exactly 85 fit."""
    url = redis_url()
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_admit_process, args=(url, 100 + p, 40, results))
             for p in range(2)]
    for proc in procs:
        proc.start()
    with ThreadPoolExecutor(8) as pool:
        thread_wins = sum(pool.map(lambda w: _admit_many(url, w, 40), range(8)))
    process_wins = sum(results.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(30)
    assert thread_wins + process_wins == 600 // 7  # no refill at a fixed virtual time
    assert level(redis_client, "tenant", 1, "out") == 600 - 7 * (600 // 7)
    assert counter(redis_client, "conc", "tenant", 1) == 600 // 7


@pytest.mark.redis_topologies("single")  # statistics of arithmetic that slots do not change
def test_counters_return_to_zero_after_a_random_mix(redis_client):
    """Random admits, settles (some twice), across tenants and keys, with time moving."""
    rng = random.Random(7)
    lim = AdmissionLimits(
        tenant=ScopeLimits(input_tpm=20_000, output_tpm=5_000, concurrent_requests=6,
                           open_streams=3),
        key=ScopeLimits(input_tpm=8_000, output_tpm=2_000, output_burst=3_000,
                        concurrent_requests=4, open_streams=2),
    )
    live: list[str] = []
    admitted = 0
    now = T0
    for i in range(400):
        now += rng.random() * 0.5
        if live and rng.random() < 0.45:
            rid = live.pop(rng.randrange(len(live)))
            for _ in range(rng.choice([1, 1, 2])):
                settlement.settle("p", rid, status="ok", prompt_tokens=rng.randint(1, 900),
                           output_tokens=rng.randint(0, 600), now=now, wfq_correction=False)
            continue
        result = admit(f"m{i}", lim, prompt=rng.randint(1, 900), out=rng.randint(1, 600),
                       stream=rng.random() < 0.5, tenant=rng.randint(1, 3),
                       key_id=rng.randint(1, 4), now=now)
        if isinstance(result, Admitted):
            live.append(f"m{i}")
            admitted += 1
        for k in redis_client.keys(key("bucket", "*")):  # A1 after every step
            kind = "key" if b":key:" in k else "tenant"
            burst = {"tenant": {b"in": 20_000, b"out": 5_000},
                     "key": {b"in": 8_000, b"out": 3_000}}[kind][k[-3:].lstrip(b":")]
            assert 0 <= float(redis_client.hget(k, "level")) <= burst
        for k in redis_client.keys(key("conc", "*")) + redis_client.keys(key("streams", "*")):
            assert int(redis_client.get(k)) >= 0
    for rid in live:
        settlement.settle("p", rid, status="cancelled", output_tokens=0, now=now,
                          wfq_correction=False)
    for k in redis_client.keys(key("conc", "*")) + redis_client.keys(key("streams", "*")):
        assert int(redis_client.get(k)) == 0, k
    assert redis_client.llen(usage_pending_key("p")) == admitted  # S2
    assert redis_client.zcard(deadlines_key("p")) == 0
    assert admitted > 50


# -- the facade: submit / cancel / deadlines, no worker needed ---------------------------------


def _submit(rid: str, lim: AdmissionLimits, *, max_tokens: int = 20, tenant: int = 1):
    from serving.submission import submit
    from serving.wire import SamplingParams

    return submit(tenant_id=tenant, key_id=tenant, weight=1.0, model="m", pool="fp",
                  prompt_token_ids=[5, 6, 7, 8], sampling=SamplingParams(max_tokens=max_tokens),
                  limits=lim, stream=True, request_id=rid)


def test_submit_rejection_is_openai_shaped_and_charges_nothing(redis_client):
    from serving.submission import Rejection
    from tests.procs import arun

    lim = limits(output_tpm=600, output_burst=100)
    too_big = arun(_submit("big", lim, max_tokens=101))
    assert isinstance(too_big, Rejection) and too_big.too_large
    assert "101 output tokens" in too_big.message and "at most 100" in too_big.message
    assert redis_client.keys("*") == []
    assert not isinstance(arun(_submit("a", lim, max_tokens=90)), Rejection)
    limited = arun(_submit("b", lim, max_tokens=20))
    assert isinstance(limited, Rejection) and limited.reason == Reason.OUTPUT_TOKENS
    assert limited.headers()["retry-after"] == str(limited.retry_after)
    assert "try again in" in limited.message


def test_cancel_while_queued_removes_and_settles_without_billing(redis_client):
    from serving import wfq
    from serving.submission import FinishEvent, Submission
    from tests.procs import arun

    async def main():
        sub = await _submit("q", limits())
        assert isinstance(sub, Submission)
        assert [e.request_id for e in wfq.Wfq(redis_client).queued_requests("fp")] == ["q"]
        assert redis_client.hget(req_key("fp", "q"), "prompt_ids")  # payload in transit
        await sub.cancel("client_disconnect")
        await sub.cancel("client_disconnect")  # idempotent
        return [e async for e in sub.events()]

    events = arun(main())
    assert len(events) == 1 and isinstance(events[0], FinishEvent)
    assert events[0].finish_reason == "abort"
    assert wfq.Wfq(redis_client).queued_requests("fp") == []
    [record] = map(json.loads, redis_client.lrange(usage_pending_key("fp"), 0, -1))
    assert record["status"] == "cancelled" and record["prompt_tokens"] == 0
    assert record["error_code"] == "client_disconnect"
    assert not redis_client.hexists(req_key("fp", "q"), "prompt_ids")
    assert level(redis_client, "tenant", 1, "out") == 600  # the whole charge came back
    assert counter(redis_client, "conc", "tenant", 1) == 0


def test_ttft_deadline_yields_an_error_and_cancels(redis_client):
    import time

    from serving.submission import ErrorEvent
    from tests.procs import arun

    lim = AdmissionLimits(tenant=limits().tenant, ttft_deadline_s=0.3, total_deadline_s=5)

    async def main():
        start = time.monotonic()  # the deadline runs from admission
        sub = await _submit("slow", lim)
        events = [e async for e in sub.events()]
        return events, time.monotonic() - start

    events, took = arun(main())
    assert [type(e) for e in events] == [ErrorEvent] and 0.25 < took < 2
    assert events[0].code == "ttft_deadline_exceeded" and events[0].retryable
    assert events[0].message.startswith("The first token did not arrive within 0.3 s")
    assert redis_client.hget(req_key("fp", "slow"), "state") == b"settled"

    async def embedding() -> list[ErrorEvent]:
        sub = await _submit("slow-embed", lim)
        return [e async for e in sub.events(first="The embeddings")]  # type: ignore[misc]

    # Worded for what the endpoint waits for: an embeddings request has no "first token".
    [expired] = arun(embedding())
    assert expired.message.startswith("The embeddings did not arrive within 0.3 s")


def test_attach_finds_only_the_tenants_own_request(redis_client):
    from serving.submission import attach
    from tests.procs import arun

    arun(_submit("mine", limits(), tenant=1))
    assert arun(attach("mine", 1)) is not None
    assert arun(attach("mine", 2)) is None  # another tenant's id reads as unknown
    assert arun(attach("nope", 1)) is None


# -- the two slots: release tokens (admit.lua A5, release.lua R1; ADR 0018) --------------------


def _charge_only(rid: str, lim: AdmissionLimits, *, now: float) -> None:
    """admit.lua alone: a gateway that died before enter.lua wrote the request."""
    calls = acc._admit_call(request_id=rid, tenant_id=1, key_id=11, pool="p", model="m",
                            prompt_tokens=100, max_output_tokens=50, stream=True, limits=lim,
                            now=now, extra=None)
    assert script("admit").run(get_redis(), calls.charge_keys, calls.charge_args)[0] == 1


def _expiry(lim: AdmissionLimits) -> float:
    return lim.total_deadline_s + acc.DEADLINE_GRACE_S + acc.RELEASE_TOKEN_GRACE_S


def test_release_gives_back_once_whoever_repeats_it(redis_client):
    lim = limits()
    admit("r", lim)
    raw = script("settle").run(redis_client, *settlement.settle_call(
        "p", "r", status="ok", output_tokens=10, now=T0))
    done = settlement.parse_settle("r", raw, T0)
    assert done is not None
    assert settlement.release(done) and counter(redis_client, "conc", "tenant", 1) == 0
    out = level(redis_client, "tenant", 1, "out")
    assert not settlement.release(done)  # a retry, or a second winner's: nothing twice
    assert counter(redis_client, "conc", "tenant", 1) == 0
    assert level(redis_client, "tenant", 1, "out") == out


def test_a_charge_whose_request_was_never_written_is_released_by_a_later_admission(
        redis_client):
    lim = limits(concurrent_requests=1)
    _charge_only("lost", lim, now=T0)
    assert counter(redis_client, "conc", "tenant", 1) == 1
    assert not redis_client.exists(req_key("p", "lost"))
    refused = admit("next", lim, now=T0 + 60)  # the lost one still holds the only slot
    assert isinstance(refused, Rejected) and refused.reason == Reason.CONCURRENCY
    assert isinstance(admit("later", lim, now=T0 + _expiry(lim) + 1), Admitted)
    assert counter(redis_client, "conc", "tenant", 1) == 1  # the new one's, not two
    assert counter(redis_client, "streams", "key", 11) == 1


def test_a_settle_whose_release_never_came_is_released_once_after_its_expiry(redis_client):
    lim = limits(concurrent_requests=1)
    admit("r", lim)
    settled = script("settle").run(redis_client, *settlement.settle_call(
        "p", "r", status="ok", output_tokens=10, now=T0))
    done = settlement.parse_settle("r", settled, T0)  # the winner dies before release.lua
    assert done is not None and counter(redis_client, "conc", "tenant", 1) == 1
    assert isinstance(admit("b", lim, now=T0 + _expiry(lim) + 1), Admitted)  # prune: freed
    assert counter(redis_client, "conc", "tenant", 1) == 1
    assert not settlement.release(done)  # the winner comes back late: the token is gone
    assert counter(redis_client, "conc", "tenant", 1) == 1  # b's slot is not given back


def test_an_id_reused_after_settlement_is_refused_and_its_new_charge_undone(redis_client):
    lim = limits()
    admit("r", lim)
    assert settlement.settle("p", "r", status="ok", output_tokens=50, now=T0,
                             wfq_correction=False)
    before = (level(redis_client, "tenant", 1, "out"), counter(redis_client, "conc", "tenant", 1))
    again = admit("r", lim)  # its token is gone, its settled req hash is still there
    assert isinstance(again, Rejected) and again.reason == Reason.DUPLICATE
    after = (level(redis_client, "tenant", 1, "out"), counter(redis_client, "conc", "tenant", 1))
    assert after == before
    assert not redis_client.zcard(acc.token_keys(1)[0])


# -- the pool's slot: enter.lua (O1, O2, W1), dispatch's claim (K1, K2), settle's WFQ step (S5) --


def test_admission_writes_queues_and_wakes_in_one_pool_slot_step(redis_client):
    """O1, W1: once admitted, the request is in its state hash, the backstop and its queue, and
    an idle worker's wake list has been pushed; nothing else is needed before dispatch."""
    from serving import wfq
    from serving.keys import wake_key

    assert isinstance(admit("r", limits()), Admitted)
    assert redis_client.hget(req_key("p", "r"), "state") == b"queued"
    assert redis_client.zscore(deadlines_key("p"), "r") is not None
    assert [e.request_id for e in wfq.Wfq(redis_client).queued_requests("p")] == ["r"]
    assert redis_client.lrange(wake_key("p"), 0, -1) == [b"1"]
    for i in range(100):  # W1: unread wakes never pile up
        admit(f"more{i}", limits(concurrent_requests=1000, open_streams=1000), prompt=1, out=1)
    assert redis_client.llen(wake_key("p")) == 64


def test_a_refused_pool_slot_step_gives_the_whole_charge_back(redis_client):
    """O2, A2: the pool's queue refuses the request after admit.lua charged it (the pool holds
    requests of the other policy): the charge comes back and nothing of the request is left."""
    from serving import wfq

    wfq.Wfq(redis_client, policy="fifo").enqueue("p", "9", "other", weight=1.0,
                                                 prompt_tokens=1, max_output_tokens=1,
                                                 kv_tokens=2)
    lim = limits()
    with pytest.raises(wfq.PolicyMismatch):
        admit("r", lim)
    assert level(redis_client, "tenant", 1, "in") == 6000
    assert level(redis_client, "tenant", 1, "out") == 600
    for name in ("conc", "streams"):
        assert counter(redis_client, name, "tenant", 1) == 0
        assert counter(redis_client, name, "key", 11) == 0
    assert not redis_client.exists(req_key("p", "r"))
    assert redis_client.zscore(deadlines_key("p"), "r") is None
    assert redis_client.zcard(acc.token_keys(1)[0]) == 0  # no release token left behind
    assert wfq.Wfq(redis_client).remove("p", "9", "other")  # drained: the policy may switch
    assert isinstance(admit("r", limits(concurrent_requests=1)), Admitted)  # no slot leaked


def _dispatch(worker: str, n: int = 10) -> list[Any]:
    from serving import wfq
    from serving.wire import PAYLOAD_FIELDS

    async def main() -> list[Any]:
        return await wfq.AsyncWfq().dispatch_many("p", n=n, free_slots=n, free_kv_tokens=10**9,
                                                  worker_id=worker, claim=PAYLOAD_FIELDS)
    return arun(main())


def test_dispatch_claims_what_it_pops_and_never_starts_a_settled_request(redis_client):
    """K1: only a queued request is claimed (running, in the in-flight set); one settled while
    still queued leaves its queue but is neither claimed nor in flight. K2: the payload is
    handed over and deleted in the same step."""
    from serving.keys import inflight_key

    lim = limits(concurrent_requests=100)
    assert isinstance(arun(admit_call("live", lim, now=None, client=None)), Admitted)
    redis_client.hset(req_key("p", "live"), mapping={"prompt_ids": b"ids", "salt": b"s"})
    assert isinstance(admit("gone", lim), Admitted)
    assert settlement.settle("p", "gone", status="cancelled", output_tokens=0, now=T0)
    got = {item.request_id: item for item in _dispatch("w1")}
    assert got["live"].claimed and got["live"].payload["prompt_ids"] == b"ids"
    assert not got["gone"].claimed and got["gone"].payload is None
    assert redis_client.smembers(inflight_key("p", "w1")) == {b"live"}
    state = redis_client.hgetall(req_key("p", "live"))
    assert state[b"state"] == b"running" and state[b"worker"] == b"w1"
    assert b"prompt_ids" not in state and b"salt" not in state  # K2
    assert _dispatch("w2") == []  # H3: nothing is dispatched twice


def test_settle_corrects_the_tenants_wfq_tags_once(redis_client, settings):
    """S5: a dispatched request's settle moves its tenant's last tag by (actual - estimated
    cost) / weight in the same step, once however often it is repeated."""
    from serving import wfq

    settings.WFQ_INPUT_PRICE, settings.WFQ_OUTPUT_PRICE, settings.WFQ_KV_PRICE = 1.0, 2.0, 0.0
    lim = limits(concurrent_requests=100)
    assert isinstance(arun(acc.admit_async(
        request_id="r", tenant_id=1, key_id=11, pool="p", model="m", prompt_tokens=100,
        max_output_tokens=50, stream=True, limits=lim, now=T0, extra={"weight": "2.0"},
        queueing=acc.Queueing(weight=2.0, kv_tokens=150))), Admitted)
    assert [item.request_id for item in _dispatch("w1")] == ["r"]
    estimated_last = float(redis_client.hget(wfq.pool_keys("p").part("last"), "1"))
    assert estimated_last == (100 + 2 * 50) / 2.0
    for _ in range(2):
        settlement.settle("p", "r", status="ok", prompt_tokens=100, output_tokens=10, now=T0)
    last = float(redis_client.hget(wfq.pool_keys("p").part("last"), "1"))
    assert last == estimated_last + ((100 + 2 * 10) - (100 + 2 * 50)) / 2.0


def test_a_request_removed_from_its_queue_gets_no_second_correction(redis_client):
    """S5: a cancel while queued gives the whole cost back through remove.lua; its settle
    (not dispatched) leaves the tags alone."""
    from serving import wfq

    assert isinstance(admit("q", limits()), Admitted)
    w = wfq.Wfq(redis_client)
    assert w.remove("p", "1", "q")
    after_remove = redis_client.hget(wfq.pool_keys("p").part("last"), "1")
    assert settlement.settle("p", "q", status="cancelled", prompt_tokens=0, output_tokens=0)
    assert redis_client.hget(wfq.pool_keys("p").part("last"), "1") == after_remove
