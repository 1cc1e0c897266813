"""End to end on real Redis with real Celery pool worker subprocesses running the simulated engine:
submit() -> WFQ -> worker -> engine -> per-step XADD -> one reader -> events -> settlement.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from infra.redis_conn import get_redis, key
from metering.keys import pool_names
from serving import transport, wfq
from serving.admission import AdmissionLimits, ScopeLimits
from serving.budgets import UnitPrices, counter_key
from serving.keys import deadlines_key, inflight_key
from serving.submission import ErrorEvent, FinishEvent, Rejection, TokenEvent, submit
from serving.tokenization import load_tokenizer
from serving.wire import SamplingParams
from tenants.budgets import BudgetRule, window
from tests import rkeys
from tests.factories import make_model, make_pool
from tests.procs import (
    Proc,
    arun,
    child_env,
    free_port,
    start_worker,
    wait_for_http,
    wait_for_worker,
    wait_until,
)

# django_db: the session then sets up the test database, which the module fixture fills.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120), pytest.mark.django_db]

WORKER_ENV = {"WORKER_HEARTBEAT_SECONDS": "0.2", "WORKER_DEAD_AFTER_SECONDS": "1.5"}
BUDGET_PRICES = UnitPrices.per_mtok("USD", Decimal(3), Decimal(1), Decimal(15))
KILL_BUDGET = BudgetRule(1, "tenant", "8", "money", 10**9, "USD", "month")
LIMITS = AdmissionLimits(
    tenant=ScopeLimits(input_tpm=1_000_000, output_tpm=1_000_000, concurrent_requests=50,
                       open_streams=50),
    ttft_deadline_s=20, total_deadline_s=60,
)
SIM = {"decode_tokens_per_s": 100.0, "pool_tokens_per_s": 5000.0}
POOLS = {
    "it-main": dict(max_sequences=8,
                    backend_settings={**SIM, "fail_request_ids": ["req-it-fail"]}),
    "it-one": dict(max_sequences=1, backend_settings=SIM),
    "it-kill": dict(max_sequences=1, backend_settings=SIM),
    "it-drain": dict(max_sequences=1, backend_settings=SIM),
}


@pytest.fixture(scope="module")
def pools(django_db_setup, django_db_blocker):
    """Pool rows the worker subprocesses read at start (committed, so they can see them)."""
    from catalog.models import Pool

    with django_db_blocker.unblock():
        model = make_model("it-sim")
        for name, fields in POOLS.items():
            make_pool(model, name=name, kv_cache_tokens=50_000, **fields)
    yield POOLS
    with django_db_blocker.unblock():
        Pool.objects.filter(name__startswith="it-").delete()
        model.delete()


@pytest.fixture(scope="module")
def workers(pools):
    get_redis().flushdb()
    started = {name: start_worker(name, worker_id=f"{name}-w1", env=WORKER_ENV)
               for name in ("it-main", "it-one")}
    for name, proc in started.items():
        wait_for_worker(get_redis(), name, f"{name}-w1", proc)
    yield started
    for proc in started.values():
        proc.stop()


def prompt(text: str) -> list[int]:
    return load_tokenizer().encode(text)


async def run_request(sub, *, stop_after: int | None = None):
    """(text, token count, last event) of a request, optionally cancelling after N tokens."""
    text, tokens, last = "", 0, None
    async for event in sub.events():
        if isinstance(event, TokenEvent):
            text += event.text
            tokens += event.token_count
            if stop_after is not None and tokens >= stop_after:
                return text, tokens, None
        else:
            last = event
    return text, tokens, last


async def until_running(rid: str, timeout: float = 10.0) -> None:
    """Wait until a worker has claimed the request (so later ones queue behind it)."""
    deadline = time.monotonic() + timeout
    while get_redis().hget(rkeys.find_req(get_redis(), rid), "state") != b"running":
        assert time.monotonic() < deadline, f"{rid} never started"
        await asyncio.sleep(0.01)


def usage_records() -> dict[str, dict]:
    return {r["request_id"]: r for r in rkeys.usage_records(get_redis())}


def all_records(count: int) -> dict[str, dict] | None:
    """The usage records once there are ``count`` of them."""
    records = usage_records()
    return records if len(records) == count else None


def wait_for_record(rid: str, timeout: float = 10.0) -> dict:
    return wait_until(lambda: usage_records().get(rid), timeout, f"usage record of {rid}")


def assert_all_released(r, timeout: float = 5.0) -> None:
    """Every concurrency and stream counter back to 0 and no deadline left, within timeout.

    The usage record is written when the request settles; the counters come back in the
    step after it (release.lua, ADR 0018), so a test that has just seen the record waits."""
    def held() -> list[bytes]:
        return [k for pattern in ("conc:*", "streams:*") for k in r.keys(key(pattern))
                if int(r.get(k) or 0) != 0]

    deadline = time.monotonic() + timeout
    while (left := held()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not left, {k: r.get(k) for k in left}
    assert all(r.zcard(deadlines_key(pool)) == 0 for pool in pool_names(r))


def test_three_tenants_complete_and_settle(workers, redis_client):
    async def one(tenant: int, i: int):
        sub = await submit(tenant_id=tenant, key_id=tenant * 10, weight=1.0, model="it-sim",
                           pool="it-main", prompt_token_ids=prompt(f"Tenant {tenant} asks {i}."),
                           sampling=SamplingParams(max_tokens=15 + 5 * i, seed=i,
                                                   ignore_eos=True),
                           limits=LIMITS, stream=True)
        assert not isinstance(sub, Rejection)
        return (tenant, sub.request_id, *await run_request(sub))

    async def main():
        return await asyncio.gather(*(one(t, i) for t in (1, 2, 3) for i in range(3)))

    results = arun(main())
    records = wait_until(lambda: all_records(9), 10, "nine usage records")
    totals: dict[int, int] = {}
    for tenant, rid, text, tokens, last in results:
        assert isinstance(last, FinishEvent), last
        assert last.finish_reason == "length" and tokens == 15 + 5 * (
            [r[1] for r in results if r[0] == tenant].index(rid))
        assert text.strip(), ("the engine's tokens decode to real text", tokens, last)
        assert last.usage.completion_tokens == tokens == records[rid]["completion_tokens"]
        assert last.usage.prompt_tokens == records[rid]["prompt_tokens"] > 0
        record = records[rid]
        assert record["tenant_id"] == tenant and record["status"] == "ok"
        assert record["pool"] == "it-main" and record["ttft_ms"] is not None
        totals[tenant] = totals.get(tenant, 0) + tokens
    by_tenant: dict[int, int] = {}
    for record in records.values():
        by_tenant[record["tenant_id"]] = by_tenant.get(record["tenant_id"], 0) + \
            record["completion_tokens"]
    assert by_tenant == totals
    assert_all_released(redis_client)
    assert redis_client.scard(inflight_key("it-main", "it-main-w1")) == 0
    # The transit payload (prompt ids) is gone once a worker took the request.
    for _t, rid, *_ in results:
        assert not redis_client.hexists(rkeys.find_req(redis_client, rid), "prompt_ids")


def test_wfq_order_holds_at_the_worker(workers, redis_client):
    """One slot, a noisy tenant's backlog, then one small request: the small one runs next."""

    async def main():
        subs = []
        for i in range(5):
            subs.append(await submit(tenant_id=1, key_id=1, weight=1.0, model="it-sim",
                                     pool="it-one", prompt_token_ids=prompt(f"Flood {i}."),
                                     sampling=SamplingParams(max_tokens=60, ignore_eos=True),
                                     limits=LIMITS, stream=True, request_id=f"noisy-{i}"))
            if i == 0:
                await until_running("noisy-0")
        subs.append(await submit(tenant_id=2, key_id=2, weight=1.0, model="it-sim",
                                 pool="it-one", prompt_token_ids=prompt("Small."),
                                 sampling=SamplingParams(max_tokens=4), limits=LIMITS,
                                 stream=True, request_id="small"))
        return await asyncio.gather(*(run_request(s) for s in subs))

    results = arun(main())
    assert all(isinstance(last, FinishEvent) for *_, last in results)
    records = usage_records()
    order = sorted(records, key=lambda rid: records[rid]["dispatched_at_ms"])
    assert order[0] == "noisy-0"
    assert order[1] == "small", order  # its tag (~12) beats the flood's (~125, 250, ...)
    assert order[2:] == [f"noisy-{i}" for i in range(1, 5)]


def test_cancel_mid_stream_aborts_and_bills_generated_tokens(workers, redis_client):
    async def main():
        sub = await submit(tenant_id=4, key_id=4, weight=1.0, model="it-sim", pool="it-main",
                           prompt_token_ids=prompt("Tell me everything."),
                           sampling=SamplingParams(max_tokens=2000, ignore_eos=True),
                           limits=LIMITS, stream=True)
        _text, seen, _ = await run_request(sub, stop_after=10)
        await sub.cancel("client_disconnect")
        return sub.request_id, seen

    rid, seen = arun(main())
    record = wait_for_record(rid)
    assert record["status"] == "cancelled" and record["error_code"] == "client_disconnect"
    assert record["finish_reason"] == "abort"
    # At 100 tokens/s a step is 10 ms: the abort lands within a step or two of the cancel.
    assert seen <= record["completion_tokens"] <= seen + 8, (seen, record)
    assert_all_released(redis_client)
    load = wait_until(lambda: (lambda h: h if h.get(b"in_flight") == b"0" else None)(
        redis_client.hgetall(rkeys.worker_key("it-main", "it-main-w1", "load"))), 3,
        "engine to drop it")
    assert load[b"running"] == b"0"


def test_ttft_deadline_cancels_a_queued_request(workers, redis_client):
    short = AdmissionLimits(tenant=LIMITS.tenant, ttft_deadline_s=0.4, total_deadline_s=30)

    async def main():
        hog = await submit(tenant_id=5, key_id=5, weight=1.0, model="it-sim", pool="it-one",
                           prompt_token_ids=prompt("Hog."),
                           sampling=SamplingParams(max_tokens=300, ignore_eos=True),
                           limits=LIMITS, stream=True)
        await asyncio.sleep(0.1)
        late = await submit(tenant_id=6, key_id=6, weight=1.0, model="it-sim", pool="it-one",
                            prompt_token_ids=prompt("Late."),
                            sampling=SamplingParams(max_tokens=5), limits=short, stream=True)
        started = time.monotonic()
        result = await run_request(late)
        elapsed = time.monotonic() - started
        await hog.cancel("test_done")
        return late.request_id, result, elapsed

    rid, (_text, tokens, last), elapsed = arun(main())
    assert isinstance(last, ErrorEvent) and last.code == "ttft_deadline_exceeded"
    assert last.retryable and tokens == 0 and 0.3 < elapsed < 2.0
    record = wait_for_record(rid)
    assert record["status"] == "cancelled" and record["completion_tokens"] == 0
    assert record["prompt_tokens"] == 0  # never reached the engine: nothing billed
    assert wfq.Wfq().queued_requests("it-one") == []


def test_engine_error_ends_the_stream_and_settles(workers, redis_client):
    async def main():
        sub = await submit(tenant_id=7, key_id=7, weight=1.0, model="it-sim", pool="it-main",
                           prompt_token_ids=prompt("Fail."),
                           sampling=SamplingParams(max_tokens=9), limits=LIMITS, stream=True,
                           request_id="req-it-fail")
        return await run_request(sub)

    _text, _tokens, last = arun(main())
    assert isinstance(last, ErrorEvent) and last.code == "engine_error"
    record = wait_for_record("req-it-fail")
    assert record["status"] == "error" and record["error_code"] == "engine_error"
    assert_all_released(redis_client)


def test_a_prompt_the_engine_refuses_is_a_400_and_charged_nothing(workers, redis_client):
    """A request the gateway admitted but the engine turns down (here a prompt beyond the
    engine's context window, as after the window was raised in the admin while this worker
    kept the old one) ends with ``engine_refused``: the client's 400, never a 500, and the
    tokens charged at admission all go back."""
    from gateway.inference.consumers import failure

    ids = (prompt("Tell me a long story about the sea. ") * 1000)[:9000]  # the window is 8192
    bucket = rkeys.bucket_key(80, "tenant", 80, "in")

    async def main():
        sub = await submit(tenant_id=80, key_id=80, weight=1.0, model="it-sim",
                           pool="it-main", prompt_token_ids=ids,
                           sampling=SamplingParams(max_tokens=9), limits=LIMITS, stream=True,
                           request_id="req-it-refused")
        charged = float(redis_client.hget(bucket, "level"))
        return charged, await run_request(sub)

    charged, (_text, tokens, last) = arun(main())
    assert tokens == 0 and isinstance(last, ErrorEvent)
    assert (last.code, last.retryable) == ("engine_refused", False)
    assert "context window (8192)" in last.message
    error = failure(last, 0)
    assert (error.status, error.type) == (400, "invalid_request_error")
    record = wait_for_record("req-it-refused")
    assert record["status"] == "error" and record["error_code"] == "engine_refused"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (0, 0)
    # 9000 tokens were taken at admission; the settle gave them all back (a full bucket).
    assert charged <= 1_000_000 - 9000 and float(redis_client.hget(bucket, "level")) == 1_000_000
    assert_all_released(redis_client)


def test_killed_worker_ends_requests_with_retryable_error_and_another_serves_the_queue(
    pools, redis_client,
):
    first = start_worker("it-kill", worker_id="it-kill-w1", env=WORKER_ENV)
    second = None
    try:
        wait_for_worker(redis_client, "it-kill", "it-kill-w1", first)

        async def job(i: int):
            return await submit(tenant_id=8 + i, key_id=8 + i, weight=1.0, model="it-sim",
                                pool="it-kill", prompt_token_ids=prompt(f"Job {i}."),
                                sampling=SamplingParams(max_tokens=500 if i == 0 else 8,
                                                        ignore_eos=True),
                                limits=LIMITS, stream=True, request_id=f"kill-{i}",
                                budget_rules=[KILL_BUDGET] if i == 0 else (),
                                prices=BUDGET_PRICES)

        async def main():
            doomed = asyncio.create_task(run_request(await job(0)))
            await until_running("kill-0")
            queued = [asyncio.create_task(run_request(await job(i))) for i in (1, 2)]
            stream = rkeys.find_stream(redis_client, "kill-0")
            while transport.delivered(redis_client, stream) < 5:
                await asyncio.sleep(0.02)
            first.kill()  # SIGKILL: no drain, no cleanup, heartbeats just stop
            killed_at = time.monotonic()
            nonlocal second
            second = start_worker("it-kill", worker_id="it-kill-w2", env=WORKER_ENV)
            lost = await doomed
            return lost, time.monotonic() - killed_at, await asyncio.gather(*queued)

        (_text, tokens, last), took, others = arun(main())
        assert isinstance(last, ErrorEvent) and last.code == "worker_lost" and last.retryable
        assert took < 1.5 + 6.0  # dead-after plus a second worker's start and first sweep
        record = wait_for_record("kill-0")
        assert record["status"] == "error" and record["error_code"] == "worker_lost"
        assert record["completion_tokens"] == tokens  # billed exactly what was delivered
        # Its money budget holds exactly that too (docs/adr/0022): the reservation of 500
        # tokens went back but for the delivered ones, to the micro-unit.
        label = window("month", datetime.now(UTC)).label
        assert int(redis_client.get(counter_key(8, KILL_BUDGET, label))) == \
            BUDGET_PRICES.micro_cost(record["prompt_tokens"], record["cached_tokens"], tokens)
        for _t, n, end in others:  # still queued when the first worker died: served by w2
            assert isinstance(end, FinishEvent) and n == 8
        records = usage_records()
        assert {records[f"kill-{i}"]["status"] for i in (1, 2)} == {"ok"}
        assert_all_released(redis_client)
        assert redis_client.zscore(rkeys.workers_key("it-kill"), "it-kill-w1") is None
        assert redis_client.scard(inflight_key("it-kill", "it-kill-w1")) == 0
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_sigterm_drains_running_sequences_and_leaves_queue_alone(pools, redis_client):
    worker = start_worker("it-drain", worker_id="it-drain-w1", env=WORKER_ENV)
    try:
        wait_for_worker(redis_client, "it-drain", "it-drain-w1", worker)

        async def main():
            running = await submit(tenant_id=11, key_id=11, weight=1.0, model="it-sim",
                                   pool="it-drain", prompt_token_ids=prompt("Drain me."),
                                   sampling=SamplingParams(max_tokens=60, ignore_eos=True),
                                   limits=LIMITS, stream=True, request_id="drain-0")
            events = running.events()
            first = await anext(events)
            assert isinstance(first, TokenEvent)
            waiting = await submit(tenant_id=12, key_id=12, weight=1.0, model="it-sim",
                                   pool="it-drain", prompt_token_ids=prompt("Wait."),
                                   sampling=SamplingParams(max_tokens=5), limits=LIMITS,
                                   stream=True, request_id="drain-1")
            worker.signal(signal.SIGTERM)
            rest = [e async for e in events]
            return rest[-1], waiting

        last, waiting = arun(main())
        assert isinstance(last, FinishEvent) and last.usage.completion_tokens == 60
        assert worker.popen.wait(20) == 0
        assert redis_client.zscore(rkeys.workers_key("it-drain"), "it-drain-w1") is None
        assert [q.request_id for q in wfq.Wfq().queued_requests("it-drain")] == ["drain-1"]
        arun(waiting.cancel("test_done"))
        assert wait_for_record("drain-1")["status"] == "cancelled"
    finally:
        worker.stop()


@pytest.mark.django_db(transaction=True)
def test_serve_starts_gateway_and_pool_workers_then_stops_on_sigterm(redis_client):
    from catalog.models import Pool

    Pool.objects.update(enabled=False)
    make_pool(make_model("serve-sim"), name="serve-one", backend_settings=SIM)
    port = free_port()
    with Proc("serve", [sys.executable, "manage.py", "serve", "--port", str(port), "--no-beat"],
              child_env(WORKER_ENV)) as proc:
        wait_for_http(f"http://127.0.0.1:{port}/healthz", timeout=60)
        wait_until(lambda: redis_client.zcard(rkeys.workers_key("serve-one")), 30, "pool worker")
        wait_until(lambda: "/admin/" in proc.logs(), 30, "the banner", proc)
        proc.signal(signal.SIGTERM)
        assert proc.popen.wait(30) == 0, proc.logs()[-3000:]
