"""The WFQ dispatcher on real Redis: the design's example, shares, capacity, cancel, refunds."""

from __future__ import annotations

import asyncio
import random

import pytest

from infra.redis_conn import new_async_redis, pool_key
from serving.wfq import (
    AsyncWfq,
    DispatchedItem,
    DuplicateRequest,
    PolicyMismatch,
    Prices,
    Wfq,
    inflight_key,
)
from tests.test_wfq_properties import assert_pool_consistent

# Run on one Redis and again on a real Redis Cluster (tests/conftest.py redis_topology): every
# script's keys must stay in one slot.
pytestmark = pytest.mark.redis_topologies("single", "cluster")

POOL = "pool-a"
BIG = 1_000_000  # free KV tokens that fit anything


@pytest.fixture
def wfq(redis_client, settings):
    # The design counts tokens with price 1, so a prompt of N tokens costs N.
    settings.WFQ_INPUT_PRICE, settings.WFQ_OUTPUT_PRICE, settings.WFQ_KV_PRICE = 1.0, 2.0, 0.0
    return Wfq(redis_client)


def put(wfq: Wfq, tenant: str, rid: str, tokens: int, *, weight: float = 1.0,
        kv: int | None = None, pool: str = POOL) -> float:
    """Enqueue a request whose cost is `tokens` (all prompt, input price 1)."""
    return wfq.enqueue(pool, tenant, rid, weight=weight, prompt_tokens=tokens,
                       max_output_tokens=0, kv_tokens=tokens if kv is None else kv)


def take(wfq: Wfq, *, free_kv: int = BIG, slots: int = 1, worker: str = "w1", **kw):
    return wfq.dispatch(POOL, free_slots=slots, free_kv_tokens=free_kv, worker_id=worker, **kw)


def test_design_worked_example_small_tenant_goes_before_the_flood(wfq):
    tags = [put(wfq, "noisy", f"n{i}", 2000) for i in range(3)]
    assert tags == [2000, 4000, 6000]
    assert put(wfq, "t1", "s1", 300) == 300

    order = [take(wfq) for _ in range(4)]
    assert [(d.request_id, d.tag) for d in order] == [
        ("s1", 300), ("n0", 2000), ("n1", 4000), ("n2", 6000)]
    # vtime follows the start tag of the request entering service, not its finish tag.
    assert wfq.vtime(POOL) == 4000
    assert take(wfq) is None


def test_fifo_policy_runs_the_same_workload_in_arrival_order(redis_client, settings):
    settings.WFQ_INPUT_PRICE = 1.0
    fifo = Wfq(redis_client, policy="fifo")
    for i in range(3):
        put(fifo, "noisy", f"n{i}", 2000)
    put(fifo, "t1", "s1", 300)
    assert [take(fifo).request_id for _ in range(4)] == ["n0", "n1", "n2", "s1"]


def test_a_pool_keeps_its_policy_until_it_drains(wfq, redis_client):
    put(wfq, "a", "r1", 1000)
    put(wfq, "b", "r2", 10)
    fifo = Wfq(redis_client, policy="fifo")
    with pytest.raises(PolicyMismatch):
        put(fifo, "a", "r3", 10)
    assert take(fifo).request_id == "r2"  # dispatch follows the pool's policy: tag order
    assert take(wfq).request_id == "r1"
    put(fifo, "a", "r4", 1000)  # empty now: the pool switches to arrival order
    put(fifo, "b", "r5", 10)
    with pytest.raises(PolicyMismatch):
        put(wfq, "a", "r6", 10)
    assert [take(wfq).request_id for _ in range(2)] == ["r4", "r5"]
    assert wfq.queued_requests(POOL) == []


def test_cost_counts_input_and_output_at_their_prices(redis_client, settings):
    settings.WFQ_INPUT_PRICE, settings.WFQ_OUTPUT_PRICE, settings.WFQ_KV_PRICE = 1.0, 2.0, 0.0
    wfq = Wfq(redis_client)
    tag = wfq.enqueue(POOL, "a", "r1", weight=2, prompt_tokens=100, max_output_tokens=50,
                      kv_tokens=150)
    assert tag == (100 * 1 + 50 * 2) / 2
    settings.WFQ_INPUT_PRICE, settings.WFQ_OUTPUT_PRICE = 0.5, 4.0
    tag2 = wfq.enqueue(POOL, "a", "r2", weight=2, prompt_tokens=100, max_output_tokens=50,
                       kv_tokens=150)
    assert tag2 == tag + (100 * 0.5 + 50 * 4) / 2


def test_cost_prices_kv_memory_as_context_times_decode_steps(redis_client, settings):
    # A request's context grows from its prompt to prompt + output over its output steps: it
    # holds output * (prompt + output / 2) token-steps of KV memory (docs/adr/0017).
    settings.WFQ_INPUT_PRICE, settings.WFQ_OUTPUT_PRICE, settings.WFQ_KV_PRICE = 1.0, 2.0, 1e-3
    wfq = Wfq(redis_client)
    long = wfq.enqueue(POOL, "a", "r1", weight=1, prompt_tokens=30_000, max_output_tokens=100,
                       kv_tokens=30_100)
    short = wfq.enqueue(POOL, "b", "r2", weight=1, prompt_tokens=100, max_output_tokens=100,
                        kv_tokens=200)
    assert long == 30_000 + 200 + 1e-3 * 100 * 30_050
    assert short == 100 + 200 + 1e-3 * 100 * 150
    # Settlement prices the actual output the same way: 10 tokens hold far less memory.
    assert Prices.from_settings().cost(30_000, 10) == 30_000 + 20 + 1e-3 * 10 * 30_005
    assert Prices(1.0, 2.0).cost(30_000, 100) == 30_200  # kv 0: the old price


@pytest.mark.redis_topologies("single")  # statistics of arithmetic that slots do not change
@pytest.mark.parametrize("policy, within", [("wfq", True), ("fifo", False)])
def test_backlogged_tenants_get_cost_shares_within_5_percent_of_weights(
        redis_client, policy, within):
    weights = {"w1": 1.0, "w2": 2.0, "w3": 3.0}
    wfq = Wfq(redis_client, policy=policy, prices=Prices(1.0, 2.0))
    rng = random.Random(7)
    served = dict.fromkeys(weights, 0.0)
    ids = iter(range(10**9))

    def refill(tenant: str) -> None:
        wfq.enqueue(POOL, tenant, f"r{next(ids)}", weight=weights[tenant],
                    prompt_tokens=rng.randint(50, 3000), max_output_tokens=rng.randint(0, 1000),
                    kv_tokens=1)

    for tenant in weights:  # every tenant stays backlogged: refill after each dispatch
        for _ in range(4):
            refill(tenant)
    for _ in range(3000):
        item = take(wfq)
        served[item.tenant_id] += item.cost
        refill(item.tenant_id)

    total = sum(served.values())
    errors = [abs(served[t] / total - w / 6.0) / (w / 6.0) for t, w in weights.items()]
    assert (max(errors) <= 0.05) is within, (policy, served)


@pytest.mark.parametrize("small_tokens, at_most", [(300, 0), (2000, 1), (4000, 2)])
@pytest.mark.parametrize("flood_done", [0, 1, 7, 25])
def test_one_request_into_a_flood_waits_at_most_one_service_slot(
        wfq, flood_done, small_tokens, at_most):
    for i in range(40):
        put(wfq, "flood", f"f{i}", 2000)
    for _ in range(flood_done):
        assert take(wfq).tenant_id == "flood"
    put(wfq, "small", "s1", small_tokens)

    before = 0
    while take(wfq).request_id != "s1":
        before += 1
    # Equal weights: a request no larger than the flood's goes next, or after one flood
    # request when its tag ties the flood's head; in general after ceil(small / flood).
    assert before <= at_most
    if flood_done and small_tokens <= 2000:
        assert before == 0  # once the flood is in service, vtime sits one request behind it


def test_head_that_does_not_fit_is_not_dispatched_until_capacity_frees(wfq, redis_client):
    put(wfq, "a", "big", 1000, kv=1000)
    assert take(wfq, free_kv=999) is None
    assert take(wfq, free_kv=5000, slots=0) is None
    assert wfq.backlog(POOL) == {"a": 1}
    assert redis_client.scard(inflight_key(POOL, "w1")) == 0

    assert take(wfq, free_kv=600, overcommit=2.0).request_id == "big"
    put(wfq, "a", "next", 500, kv=500)
    assert take(wfq, free_kv=499) is None
    assert take(wfq, free_kv=500).request_id == "next"


def test_head_of_line_by_tag_unless_lookahead_is_asked_for(wfq):
    put(wfq, "a", "big", 1000, kv=5000)  # smallest tag, too big for this worker
    put(wfq, "b", "small", 1500, kv=100)
    assert take(wfq, free_kv=1000) is None  # no skipping ahead by default
    got = take(wfq, free_kv=1000, lookahead=1)
    assert got.request_id == "small"
    assert wfq.backlog(POOL) == {"a": 1}


def test_dispatch_many_stops_at_slots_and_kv_budget(wfq, redis_client):
    for i in range(6):
        put(wfq, f"t{i}", f"r{i}", 100 + i, kv=300)
    got = wfq.dispatch_many(POOL, n=10, free_slots=4, free_kv_tokens=1000, worker_id="w9")
    assert [g.request_id for g in got] == ["r0", "r1", "r2"]  # the 4th would need 1,200 KV
    running = {m.decode() for m in redis_client.smembers(inflight_key(POOL, "w9"))}
    assert running == {"r0", "r1", "r2"}
    got = wfq.dispatch_many(POOL, n=2, free_slots=4, free_kv_tokens=BIG, worker_id="w9")
    assert [g.request_id for g in got] == ["r3", "r4"]
    assert sum(wfq.backlog(POOL).values()) == 1
    assert_pool_consistent(redis_client, POOL)


def test_a_dispatch_says_whether_requests_are_left_queued(wfq):
    """Dispatched.more: a worker given fewer than it asked for looks again on its own events
    only while some are (workers/host.py _wake_self). Blocked heads count as queued."""
    for tenant, rid in (("a", "q1"), ("a", "q2"), ("b", "q3")):
        put(wfq, tenant, rid, 100, kv=300)
    got = wfq.dispatch_many(POOL, n=10, free_slots=4, free_kv_tokens=700, worker_id="w9")
    assert [g.request_id for g in got] == ["q1", "q3"] and got.more  # q2's KV does not fit
    got = wfq.dispatch_many(POOL, n=10, free_slots=4, free_kv_tokens=BIG, worker_id="w9")
    assert [g.request_id for g in got] == ["q2"] and not got.more
    got = wfq.dispatch_many(POOL, n=10, free_slots=4, free_kv_tokens=BIG, worker_id="w9")
    assert got == [] and not got.more


def test_remove_repairs_the_head_and_gives_back_the_cost(wfq, redis_client):
    put(wfq, "a", "a1", 100)
    put(wfq, "a", "a2", 100)
    put(wfq, "a", "a3", 100)
    put(wfq, "b", "b1", 150)
    assert wfq.remove(POOL, "a", "a1")  # the head: a's queue moves up into its place
    assert redis_client.zscore(pool_key("wfq", POOL, "heads"), "a") == 100
    assert [(q.request_id, q.tag) for q in wfq.queued_requests(POOL)] == [
        ("a2", 100), ("a3", 200), ("b1", 150)]
    assert_pool_consistent(redis_client, POOL)
    assert not wfq.remove(POOL, "b", "a2")  # not b's request: nobody cancels another's
    assert not wfq.remove(POOL, "a", "a1")  # already gone
    assert put(wfq, "a", "a4", 100) == 300

    assert [take(wfq).request_id for _ in range(2)] == ["a2", "b1"]
    assert not wfq.remove(POOL, "a", "a2")  # dispatched: too late to remove
    assert wfq.remove(POOL, "a", "a4")  # the newest: exactly undone
    assert put(wfq, "a", "a5", 100) == 300
    assert wfq.remove(POOL, "a", "a5") and wfq.remove(POOL, "a", "a3")
    assert wfq.backlog(POOL) == {}
    assert_pool_consistent(redis_client, POOL)


def test_complete_moves_the_last_tag_by_the_real_cost_once(wfq):
    est = put(wfq, "a", "a1", 1000)
    item = take(wfq)
    kwargs = dict(estimated_cost=item.cost, actual_cost=400, weight=1.0, request_id="a1",
                  worker_id="w1")
    assert wfq.complete(POOL, "a", **kwargs) == est - 600
    assert wfq.complete(POOL, "a", **kwargs) is None  # retried: no second refund
    assert put(wfq, "a", "a2", 100) == 400 + 100


def test_complete_never_moves_a_tag_below_virtual_time(wfq):
    for i in range(3):
        put(wfq, "a", f"a{i}", 1000)
    put(wfq, "b", "b0", 5000)
    for _ in range(3):
        take(wfq)  # a0, a1, a2: vtime is now 2,000, a's last tag 3,000
    assert wfq.vtime(POOL) == 2000
    assert wfq.complete(POOL, "a", estimated_cost=1000, actual_cost=0, weight=1.0) == 2000
    assert wfq.complete(POOL, "a", estimated_cost=1000, actual_cost=0, weight=1.0) == 2000
    assert put(wfq, "a", "a3", 100) == 2100  # no banked credit: same as a newcomer
    assert wfq.complete(POOL, "a", estimated_cost=0, actual_cost=300, weight=3.0) == 2200


def test_idle_tenant_does_not_bank_credit(wfq):
    put(wfq, "a", "a0", 100)
    for i in range(5):
        put(wfq, "b", f"b{i}", 1000)
    for _ in range(5):
        take(wfq)
    # a has been idle since tag 100; vtime moved to b's start tag 3,000.
    assert put(wfq, "a", "a1", 100) == wfq.vtime(POOL) + 100 == 3100


def test_duplicate_and_malformed_requests_are_refused(wfq):
    put(wfq, "a", "r1", 10)
    with pytest.raises(DuplicateRequest):
        put(wfq, "b", "r1", 10)
    with pytest.raises(ValueError):
        put(wfq, "a", "r2", 10, weight=0)
    with pytest.raises(ValueError):
        put(wfq, "a|x", "r3", 10)
    with pytest.raises(ValueError):
        put(wfq, "a", "r4", 10, pool="bad:pool")
    with pytest.raises(ValueError):
        wfq.enqueue(POOL, "a", "r5", weight=1, prompt_tokens=-1, max_output_tokens=0,
                    kv_tokens=0)
    with pytest.raises(ValueError):
        take(wfq, free_kv=float("nan"))
    assert wfq.backlog(POOL) == {"a": 1}


def test_reset_deletes_every_key_of_the_pool(wfq, redis_client):
    for i in range(5):
        put(wfq, f"t{i % 2}", f"r{i}", 10)
    put(wfq, "x", "other", 10, pool="pool-b")
    take(wfq)
    wfq.reset(POOL)
    assert list(redis_client.scan_iter(match=pool_key("wfq", POOL, "*"))) == []
    assert wfq.backlog("pool-b") == {"x": 1}


def test_async_client_runs_the_same_scripts(redis_client):
    async def scenario() -> list[tuple[str, float]]:
        client = new_async_redis()
        try:
            awfq = AsyncWfq(client, prices=Prices(1.0, 2.0))
            for i in range(3):
                await awfq.enqueue(POOL, "noisy", f"n{i}", weight=1, prompt_tokens=2000,
                                   max_output_tokens=0, kv_tokens=1)
            await awfq.enqueue(POOL, "t1", "s1", weight=1, prompt_tokens=300,
                               max_output_tokens=0, kv_tokens=1)
            assert await awfq.backlog(POOL) == {"t1": 1, "noisy": 3}
            assert await awfq.remove(POOL, "noisy", "n2")
            got = await awfq.dispatch_many(POOL, n=5, free_slots=5, free_kv_tokens=10,
                                           worker_id="wa")
            # t1's last tag (300) is behind vtime (2,000, n1's start): clamped up to it.
            assert await awfq.complete(POOL, "t1", estimated_cost=300, actual_cost=300,
                                       weight=1, request_id="s1", worker_id="wa") == 2000
            assert await awfq.queued_requests(POOL) == []
            assert await awfq.vtime(POOL) == 2000
            await awfq.reset(POOL)
            return [(g.request_id, g.tag) for g in got]
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == [("s1", 300), ("n0", 2000), ("n1", 4000)]


def test_queued_requests_lists_arrival_order_with_tags(wfq):
    put(wfq, "b", "b1", 500, weight=2)
    put(wfq, "a", "a1", 100)
    queued = wfq.queued_requests(POOL)
    assert [(q.request_id, q.tenant_id, q.tag, q.seq) for q in queued] == [
        ("b1", "b", 250, 1), ("a1", "a", 100, 2)]


def _run_pool(wfq: Wfq, steps: int, *, slots: int, actual: dict[str, float], refill,
              rng: random.Random, complete: bool = True,
              inflight: list[DispatchedItem] | None = None) -> list[DispatchedItem]:
    """Keep `slots` requests in flight; each step completes a random one and refills."""
    inflight = [] if inflight is None else inflight
    order: list[DispatchedItem] = []
    for _ in range(steps):
        while len(inflight) < slots and (item := take(wfq)) is not None:
            inflight.append(item)
            order.append(item)
        done = inflight.pop(rng.randrange(len(inflight)))
        if complete:
            wfq.complete(POOL, done.tenant_id, estimated_cost=done.cost,
                         actual_cost=actual[done.request_id], weight=done.weight,
                         request_id=done.request_id, worker_id="w1")
        refill(done.tenant_id)
    return order


def _over_estimator_share(client, *, slots: int, complete: bool) -> float:
    """Real work served to "over" (asks 10x the output it uses, weight 1) next to "exact"."""
    prices, weights = Prices(1.0, 2.0), {"over": 1.0, "exact": 2.0}
    wfq = Wfq(client, prices=prices)
    wfq.reset(POOL)
    rng, actual, ids = random.Random(3), {}, iter(range(10**9))

    def refill(tenant: str) -> None:
        rid, prompt, out = f"r{next(ids)}", rng.randint(50, 1000), rng.randint(10, 500)
        actual[rid] = prices.cost(prompt, out)
        wfq.enqueue(POOL, tenant, rid, weight=weights[tenant], prompt_tokens=prompt,
                    max_output_tokens=out * (10 if tenant == "over" else 1), kv_tokens=1)

    for tenant in weights:
        for _ in range(20):
            refill(tenant)
    order = _run_pool(wfq, 1500, slots=slots, actual=actual, refill=refill, rng=rng,
                      complete=complete)
    work = {t: sum(actual[i.request_id] for i in order if i.tenant_id == t) for t in weights}
    return work["over"] / sum(work.values())


@pytest.mark.redis_topologies("single")  # statistics of arithmetic that slots do not change
@pytest.mark.parametrize("slots", [1, 4])
def test_completions_give_an_over_estimating_tenant_back_most_of_its_share(redis_client, slots):
    # Charged on the estimate alone, "over" gets about a quarter of its weighted share (1/3).
    assert _over_estimator_share(redis_client, slots=slots, complete=False) < 0.12
    with_refunds = _over_estimator_share(redis_client, slots=slots, complete=True)
    assert 0.15 < with_refunds <= 1 / 3  # most of it back, never more than its share


def test_refunds_from_parallel_requests_bank_no_credit_against_a_newcomer(redis_client):
    # "over" runs alone, 8 at a time, asking 50x the output it uses, with a deep queue that
    # arrived early. Refunds must not leave it so far behind vtime that a newcomer with the
    # same weight and the same real cost waits behind its backlog.
    prices, rng, actual, ids = Prices(1.0, 2.0), random.Random(1), {}, iter(range(10**9))
    wfq = Wfq(redis_client, prices=prices)

    def add(tenant: str) -> None:
        rid = f"r{next(ids)}"
        actual[rid] = prices.cost(100, 100)
        wfq.enqueue(POOL, tenant, rid, weight=1.0, prompt_tokens=100,
                    max_output_tokens=100 * (50 if tenant == "over" else 1), kv_tokens=1)

    for _ in range(600):
        add("over")
    running: list[DispatchedItem] = []
    _run_pool(wfq, 200, slots=8, actual=actual, refill=lambda t: None, rng=rng,
              inflight=running)
    for _ in range(500):
        add("new")
    order = _run_pool(wfq, 200, slots=8, actual=actual, refill=lambda t: None, rng=rng,
                      inflight=running)
    assert sum(i.tenant_id == "new" for i in order[:200]) >= 100
