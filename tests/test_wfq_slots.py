"""Slot fairness of the WFQ dispatcher (serving/lua/wfq/dispatch.lua, S1-S3; docs/adr/0006).

A dispatched sequence keeps its slot until it ends. These tests drive one worker's slots by hand
(the worker passes its own per-tenant running counts) on a clock passed as ``now``, and check
that a flood cannot take the slots a recently active tenant will need, that a lone tenant still
gets every slot, and that FIFO and ``WFQ_SLOT_RESERVE=0`` stay plain.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from infra.redis_conn import pool_key
from serving.wfq import EngineShares, Prices, Wfq
from tests.test_wfq_properties import Model, assert_active_consistent, assert_pool_consistent

POOL = "slots"
SLOTS = 8
BIG = 10**9


@pytest.fixture
def wfq(redis_client, settings):
    settings.WFQ_ACTIVE_WINDOW_SECONDS, settings.WFQ_SLOT_RESERVE = 5.0, 0.5
    return Wfq(redis_client, prices=Prices(1.0, 1.0))


class Worker:
    """One worker's slots, as EngineHost keeps them: running ids per tenant."""

    def __init__(self, wfq: Wfq, slots: int = SLOTS, name: str = "w1") -> None:
        self.wfq, self.slots, self.name = wfq, slots, name
        self.running: dict[str, str] = {}  # rid -> tenant

    def counts(self) -> Counter[str]:
        return Counter(self.running.values())

    def fill(self, now: float, *, fair: bool = True) -> list[str]:
        free = self.slots - len(self.running)
        items = self.wfq.dispatch_many(POOL, n=free, free_slots=free, free_kv_tokens=BIG,
                                       worker_id=self.name, now=now,
                                       running=dict(self.counts()) if fair else None)
        for item in items:
            assert item.request_id not in self.running
            self.running[item.request_id] = item.tenant_id
        return [item.tenant_id for item in items]

    def finish(self, tenant: str | None = None) -> None:
        for rid, t in list(self.running.items()):
            if tenant is None or t == tenant:
                del self.running[rid]


def put(wfq: Wfq, tenant: str, rid: str, tokens: int, now: float, weight: float = 1.0) -> None:
    wfq.enqueue(POOL, tenant, rid, weight=weight, prompt_tokens=tokens, max_output_tokens=0,
                kv_tokens=tokens, now=now)


def flood(wfq: Wfq, now: float, count: int = 40, tenant: str = "noisy") -> None:
    for i in range(count):
        put(wfq, tenant, f"{tenant}-{now}-{i}", 2000, now)


def small_round(wfq: Wfq, worker: Worker, now: float) -> None:
    """The three small tenants each send one request, which runs and ends."""
    for t in ("t1", "t2", "t3"):
        put(wfq, t, f"{t}-{now}", 300, now)
    assert sorted(worker.fill(now)) == ["t1", "t2", "t3"]
    for t in ("t1", "t2", "t3"):
        worker.finish(t)


def test_a_late_small_tenant_gets_a_slot_at_once_while_a_flood_holds_the_pool(wfq, redis_client):
    worker = Worker(wfq)
    small_round(wfq, worker, now=100.0)  # t1..t3 are active (seen), idle right now
    flood(wfq, now=100.5)
    # 4 active tenants, equal weights: cap 2 each. The flood may go past its cap while the
    # free slots left stay >= the others' unused shares (6), at most half the slots (4): 4.
    assert worker.fill(now=100.6) == ["noisy"] * 4
    assert worker.fill(now=100.7) == []  # the flood stays queued; 4 slots stay free
    # The small tenants' next requests go in at once, without waiting for a flood sequence.
    for t in ("t1", "t2", "t3"):
        put(wfq, t, f"{t}-late", 300, now=101.0)
    assert sorted(worker.fill(now=101.0)) == ["t1", "t2", "t3"]
    assert worker.counts() == {"noisy": 4, "t1": 1, "t2": 1, "t3": 1}
    assert_pool_consistent(redis_client, POOL)

    # Without slot fairness (no running counts) the flood takes every slot, and a late small
    # request waits for a 2,000-token sequence to end: the issue this fixes.
    other = Worker(wfq, name="w2")
    assert other.fill(now=101.1, fair=False) == ["noisy"] * SLOTS
    put(wfq, "t1", "t1-blocked", 300, now=101.2)
    assert other.fill(now=101.2, fair=False) == []


def test_a_lone_tenant_gets_every_slot(wfq):
    worker = Worker(wfq)
    flood(wfq, now=10.0)
    assert worker.fill(now=10.0) == ["noisy"] * SLOTS
    worker.finish()
    assert worker.fill(now=11.0) == ["noisy"] * SLOTS  # a fresh worker view: all again
    for _ in range(3):  # and slot by slot as its sequences end
        del worker.running[next(iter(worker.running))]
    assert worker.fill(now=12.0) == ["noisy"] * 3


def test_the_flood_gets_the_slots_back_once_the_others_go_quiet(wfq):
    worker = Worker(wfq)
    small_round(wfq, worker, now=100.0)
    flood(wfq, now=100.0)
    assert worker.fill(now=101.0) == ["noisy"] * 4
    assert worker.fill(now=104.9) == []  # t1..t3 enqueued 4.9 s ago: still active
    assert worker.fill(now=105.1) == ["noisy"] * 4  # past the 5 s window: work-conserving


def test_running_here_counts_as_active_without_any_window(wfq, settings):
    settings.WFQ_ACTIVE_WINDOW_SECONDS = 0.0
    worker = Worker(wfq)
    put(wfq, "t1", "long-t1", 300, now=1.0)
    assert worker.fill(now=1.0) == ["t1"]
    flood(wfq, now=2.0)
    # Two active tenants (t1 runs here): caps 4 and 4; t1's 3 unused slots stay free.
    assert worker.fill(now=3.0) == ["noisy"] * 4
    put(wfq, "t1", "next-t1", 300, now=3.0)
    assert worker.fill(now=3.0) == ["t1"]


def test_weights_set_the_shares_and_the_reserve_fraction_bounds_the_headroom(wfq, settings):
    settings.WFQ_SLOT_RESERVE = 1.0  # keep every unused share free
    worker = Worker(wfq)
    put(wfq, "gold", "g0", 300, now=0.0, weight=3.0)
    assert worker.fill(now=0.0) == ["gold"]
    worker.finish()
    flood(wfq, now=0.5)
    # Active weights 3 (gold, recent) and 1 (noisy): noisy's cap is floor(8 / 4) = 2, gold's 6.
    assert worker.fill(now=1.0) == ["noisy"] * 2
    settings.WFQ_SLOT_RESERVE = 0.25  # the reserve is at most 2 of 8 slots
    assert worker.fill(now=1.0) == ["noisy"] * 4
    settings.WFQ_SLOT_RESERVE = 0.0  # S3: plain work-conserving WFQ
    assert worker.fill(now=1.0) == ["noisy"] * 2


def test_a_blocked_tenant_is_skipped_for_the_next_tag_not_waited_for(wfq, redis_client):
    worker = Worker(wfq)
    small_round(wfq, worker, now=0.0)
    flood(wfq, now=0.0)
    assert worker.fill(now=0.1) == ["noisy"] * 4
    # t1 queues a request whose tag is behind the flood's head: noisy (blocked) is skipped.
    for i in range(20):
        put(wfq, "t1", f"t1-big-{i}", 5000, now=0.2)
    head = min(wfq.queued_requests(POOL), key=lambda e: e.tag)
    assert head.tenant_id == "noisy"
    vtime = wfq.vtime(POOL)
    got = worker.fill(now=0.3)
    assert got and set(got) == {"t1"}
    assert wfq.vtime(POOL) >= vtime
    assert_pool_consistent(redis_client, POOL)


def test_fifo_ignores_slot_fairness(redis_client, settings):
    settings.WFQ_SLOT_RESERVE = 1.0
    fifo = Wfq(redis_client, policy="fifo", prices=Prices(1.0, 1.0))
    worker = Worker(fifo)
    small_round(fifo, worker, now=0.0)
    flood(fifo, now=0.5)
    assert worker.fill(now=1.0) == ["noisy"] * SLOTS


def test_running_counts_are_validated(wfq):
    with pytest.raises(ValueError):
        wfq.dispatch_many(POOL, n=1, free_slots=1, free_kv_tokens=BIG, worker_id="w1",
                          running={"bad id": 1})
    with pytest.raises(ValueError):
        wfq.dispatch_many(POOL, n=1, free_slots=1, free_kv_tokens=BIG, worker_id="w1",
                          running={"t1": -1})


def test_seen_keeps_one_member_per_tenant_and_dispatch_prunes_it(wfq, redis_client):

    for i in range(5):
        put(wfq, "t1", f"a{i}", 10, now=float(i))
    put(wfq, "t2", "b0", 10, now=1.0)
    seen = pool_key("wfq", POOL, "seen")
    assert redis_client.zrange(seen, 0, -1, withscores=True) == [(b"t2", 1.0), (b"t1", 4.0)]
    Worker(wfq).fill(now=8.5)  # window 5 s: t2 (1.0) goes, t1 (4.0) stays
    assert redis_client.zrange(seen, 0, -1) == [b"t1"]
    wfq.reset(POOL)
    assert not redis_client.exists(seen, pool_key("wfq", POOL, "weight"))


@pytest.mark.parametrize("seed", range(6))
def test_many_tenants_match_the_model_that_computes_every_cap(wfq, redis_client, settings,
                                                               seed):
    """The script reads aggregates and only the caps it needs (dispatch.lua); the model
    computes every active tenant's cap and the whole unused sum. With up to 150 tenants, some
    heavy, one worker kept nearly full (so S2 decides), time jumps past the window and a mass
    expiry beyond the 128 members pruned per call, every decision and the H7 aggregates must
    agree."""
    rng = random.Random(seed)
    settings.WFQ_SLOT_RESERVE = rng.choice([0.25, 0.5, 1.0])
    slots, count = rng.choice([8, 16, 64]), rng.choice([20, 60, 150])
    model, now, seq = Model("wfq"), 1000.0, 0
    tenants = [f"t{i}" for i in range(count)]
    weights = {t: rng.choice([0.5, 1.0, 1.0, 2.0, 3.0, 8.0, 25.0]) for t in tenants}
    running: dict[str, str] = {}  # rid -> tenant, this worker's sequences
    entries = {}

    def put_one(tenant: str) -> str:
        nonlocal seq
        seq += 1
        tokens = rng.randint(10, 3000)
        wfq.enqueue(POOL, tenant, f"r{seq}", weight=weights[tenant], prompt_tokens=tokens,
                    max_output_tokens=0, kv_tokens=1, now=now)
        model.enqueue(tenant, f"r{seq}", float(tokens), 1, now, weights[tenant])
        return f"r{seq}"

    # A mass expiry: every tenant enqueues at once and withdraws, so it is active through
    # seen only; past the window, dispatch prunes 128 per call and the rest on the next ones.
    for t in tenants:
        rid = put_one(t)
        assert wfq.remove(POOL, t, rid)
        model.remove(t, rid)
    now += 6.0
    # Half the runs keep to three tenants after the expiry, so that often every active tenant
    # is queued while one is over its cap (S4 decides).
    few = rng.random() < 0.5
    for _ in range(500):
        roll = rng.random()
        if roll < 0.4:
            put_one(rng.choice(tenants[: 3 if few else rng.choice([3, count])]))
        elif roll < 0.85:
            free = min(slots - len(running), rng.choice([0, 1, 1, 2, 3, slots]))
            n, lookahead = rng.randint(1, 4), rng.choice([0, 0, 1])
            counts = Counter(running.values())
            got = wfq.dispatch_many(POOL, n=n, free_slots=free, free_kv_tokens=BIG,
                                    worker_id="w1", lookahead=lookahead,
                                    running=dict(counts), now=now)
            want = model.dispatch(min(n, free), BIG, lookahead, (counts, free, now))
            assert [(g.request_id, g.tag) for g in got] == [(w.request_id, w.tag) for w in want]
            for item in got:
                running[item.request_id] = item.tenant_id
                entries[item.request_id] = item
        elif running:
            rid = rng.choice(sorted(running))
            del running[rid]
            item = entries.pop(rid)
            assert wfq.complete(POOL, item.tenant_id, estimated_cost=item.cost,
                                actual_cost=item.cost, weight=item.weight, request_id=rid,
                                worker_id="w1") == model.complete(item.tenant_id, 0.0)
        now += rng.choice([0.0, 0.0, 0.5, 1.0, 6.0])
        assert_active_consistent(redis_client, POOL, model.active())
    assert_pool_consistent(redis_client, POOL)


def _dispatch_against_model(wfq, puts, running, free, n, now):
    """Enqueue puts (tenant, cost, weight) at t=0 into both, then one fair dispatch."""
    model = Model("wfq")
    for i, (tenant, cost, weight) in enumerate(puts):
        put(wfq, tenant, f"{tenant}-{i}", cost, now=0.0, weight=weight)
        model.enqueue(tenant, f"{tenant}-{i}", float(cost), cost, 0.0, weight)
    got = wfq.dispatch_many(POOL, n=n, free_slots=free, free_kv_tokens=BIG, worker_id="w1",
                            running=running, now=now)
    want = model.dispatch(min(n, free), BIG, 0, (Counter(running), free, now))
    assert [g.request_id for g in got] == [w.request_id for w in want]
    return [g.tenant_id for g in got]


def test_a_heavy_tenant_below_a_cap_of_two_among_many_is_not_blocked(wfq):
    # 8 slots, weights 6 + 16 x 1: the heavy tenant's cap is floor(8 * 6 / 22) = 2, every
    # other cap 1, so "every cap is 1" must not be assumed (large mode, S2 failing: 1 free).
    lights = [f"l{i}" for i in range(1, 17)]
    puts = [("heavy", 6, 6.0)] + [(t, 100, 1.0) for t in lights]
    running = {"heavy": 1, **{t: 1 for t in lights[:6]}}
    assert _dispatch_against_model(wfq, puts, running, free=1, n=1, now=1.0) == ["heavy"]


def test_the_exact_weight_sum_is_the_one_of_the_call_start(wfq, settings):
    # a and b (weight 5) run here with a cap of floor(8 * 5 / 18) = 2; a's only request goes
    # first while S2 still passes, which empties a's queue and, a being out of the window,
    # takes it out of the active set. b's cap needs the exact sum next: still 18, not 23.
    settings.WFQ_ACTIVE_WINDOW_SECONDS, settings.WFQ_SLOT_RESERVE = 1.0, 0.25
    cs = [f"c{i}" for i in range(1, 9)]
    puts = [("a", 10, 5.0), ("b", 20, 5.0), ("b", 500, 5.0)] + [(t, 100, 1.0) for t in cs]
    running = {"a": 1, "b": 1, "c1": 1, "c2": 1, "c3": 1}
    assert _dispatch_against_model(wfq, puts, running, free=3, n=2, now=5.0) == ["a", "b"]


def test_the_reserve_shrinks_as_a_call_fills_other_tenants_shares(wfq):
    # 8 slots, 5 tenants of weight 1 (caps 1); x runs 3 here, 5 free, reserve at most 4. o1
    # takes its share first; the unused shares are then 3, so x may take a 4th slot: the
    # reserve is min(unused, 4) at every pick, not 4 for the whole call.
    puts = [("o1", 10, 1.0), ("x", 20, 1.0)] + [(f"o{i}", 100, 1.0) for i in (2, 3, 4)]
    assert _dispatch_against_model(wfq, puts, {"x": 3}, free=5, n=2, now=1.0) == ["o1", "x"]


def test_backlogged_tenants_take_slots_in_tag_order_past_their_caps(wfq):
    # S4: a, b and c all queued; a runs 4 (cap 2), b 1, c 2, one slot free. S2 would keep it
    # for b's unused share, but b is queued and its tag is behind a's: a goes first. (With
    # mixed lengths a tenant whose requests hold slots long for little work never reached its
    # share of the service otherwise; docs/fairness.md.)
    puts = [("a", 10, 1.0), ("b", 100, 1.0), ("c", 100, 1.0), ("b", 100, 1.0)]
    running = {"a": 4, "b": 1, "c": 2}
    assert _dispatch_against_model(wfq, puts, running, free=1, n=1, now=1.0) == ["a"]


def test_the_reserve_holds_while_an_active_tenant_has_nothing_queued(wfq):
    # The same, but c has nothing queued (it runs here): S2 keeps the free slot for b's
    # unused share, so a is skipped and b, below its cap, takes it.
    puts = [("a", 10, 1.0), ("b", 100, 1.0), ("b", 100, 1.0)]
    running = {"a": 4, "b": 1, "c": 2}
    assert _dispatch_against_model(wfq, puts, running, free=1, n=1, now=1.0) == ["b"]


def test_s4_ends_within_a_call_when_a_dispatch_empties_a_queue(wfq):
    # All queued at the start, so a (over its cap) goes first. That empties a's queue, S2
    # applies again, and c (at its cap, next by tag) is skipped for b, below its cap.
    puts = [("a", 10, 1.0), ("b", 100, 1.0), ("c", 50, 1.0), ("c", 60, 1.0)]
    running = {"a": 3, "b": 1, "c": 2}
    assert _dispatch_against_model(wfq, puts, running, free=2, n=2, now=1.0) == ["a", "b"]


# --- Engine shares (rule E, docs/adr/0017): the prefill budget and the KV cache ------------

PREFILL_CAP = 20_000  # prompt tokens the engine prefills over the horizon
KV_CAP = 100_000


class EngineWorker(Worker):
    """A worker that also passes its engine's state: per tenant the KV tokens it holds and the
    prompt tokens not yet prefilled (kv_tokens until the engine reports the first token)."""

    def __init__(self, wfq: Wfq, slots: int = SLOTS) -> None:
        super().__init__(wfq, slots)
        self.kv: dict[str, int] = {}  # rid -> kv tokens
        self.prefilled: set[str] = set()

    def shares(self) -> EngineShares:
        pend: Counter[str] = Counter()
        held: Counter[str] = Counter()
        for rid, tenant in self.running.items():
            held[tenant] += self.kv[rid]
            if rid not in self.prefilled:
                pend[tenant] += self.kv[rid]
        return EngineShares(PREFILL_CAP, KV_CAP, dict(pend), dict(held))

    def fill(self, now: float, *, fair: bool = True) -> list[str]:
        free = self.slots - len(self.running)
        items = self.wfq.dispatch_many(POOL, n=free, free_slots=free, free_kv_tokens=BIG,
                                       worker_id=self.name, now=now,
                                       running=dict(self.counts()), engine=self.shares())
        for item in items:
            self.running[item.request_id] = item.tenant_id
            self.kv[item.request_id] = item.kv_tokens
        return [item.tenant_id for item in items]

    def prefill(self, tenant: str) -> None:
        self.prefilled |= {r for r, t in self.running.items() if t == tenant}


def long_prompts(wfq: Wfq, now: float, count: int = 10, tokens: int = 24_000,
                 tenant: str = "long") -> None:
    for i in range(count):
        put(wfq, tenant, f"{tenant}-{now}-{i}", tokens, now)


def test_long_prompts_stay_within_their_prefill_share_while_others_are_active(wfq):
    worker = EngineWorker(wfq)
    small_round(wfq, worker, now=100.0)  # t1..t3 active: 4 tenants, prefill cap 5,000 each
    long_prompts(wfq, now=100.5)
    # One long prompt (24,000 > its cap: a request is never refused for its own size), then
    # nothing more while it waits for prefill, though 7 slots are free.
    assert worker.fill(100.5) == ["long"]
    assert worker.fill(100.6) == []
    put(wfq, "t1", "t1-late", 300, 100.7)
    assert worker.fill(100.7) == ["t1"]  # the others still get in at once
    worker.prefill("long")  # its prompt is prefilled: the next one may go
    assert worker.fill(100.8) == ["long"]


def test_a_lone_tenant_gets_all_of_the_prefill_budget(wfq):
    worker = EngineWorker(wfq)
    long_prompts(wfq, now=100.0, count=20, tokens=3_000)
    # Alone (E2): every slot, though 8 x 3,000 pending is past any share.
    assert worker.fill(100.0) == ["long"] * SLOTS


def test_kv_share_holds_even_when_prefill_is_done(wfq):
    worker = EngineWorker(wfq, slots=16)
    small_round(wfq, worker, now=100.0)
    long_prompts(wfq, now=100.5, count=10, tokens=20_000)
    # KV cap 25,000 a tenant (4 active): after one 20,000-token request (prefilled), a second
    # one brings it to 40,000 >= 25,000, and no third follows; prefill shares alone would let it.
    assert worker.fill(100.5) == ["long"]
    worker.prefill("long")
    assert worker.fill(100.6) == ["long"]
    worker.prefill("long")
    assert worker.fill(100.7) == []
    worker.finish("long")
    assert worker.fill(100.8) == ["long"]


def test_weights_scale_the_engine_shares(wfq):
    worker = EngineWorker(wfq, slots=16)
    for t in ("t1", "t2"):
        put(wfq, t, f"{t}-0", 100, 100.0)
    assert sorted(worker.fill(100.0)) == ["t1", "t2"]
    worker.finish()
    # heavy has weight 6 of 8 units: prefill cap 15,000, so three 4,000-token prompts pend at
    # once (0, 4,000, 8,000, 12,000 < 15,000: four); light (weight 1) gets one.
    for i in range(6):
        wfq.enqueue(POOL, "heavy", f"h{i}", weight=6.0, prompt_tokens=4_000,
                    max_output_tokens=0, kv_tokens=4_000, now=100.5)
    got = worker.fill(100.5)
    assert got.count("heavy") == 4
    for i in range(3):
        put(wfq, "t1", f"light{i}", 4_000, 100.6)
    assert worker.fill(100.6).count("t1") == 1


def test_engine_shares_never_move_tags_or_vtime(wfq, redis_client):
    worker = EngineWorker(wfq)
    small_round(wfq, worker, now=100.0)
    long_prompts(wfq, now=100.5)
    worker.fill(100.5)
    before = (wfq.vtime(POOL), wfq.queued_requests(POOL))
    assert worker.fill(100.6) == []  # blocked by E
    assert (wfq.vtime(POOL), wfq.queued_requests(POOL)) == before
    assert_pool_consistent(redis_client, POOL)


def test_engine_share_arguments_are_checked(wfq):
    bad = EngineShares(PREFILL_CAP, KV_CAP, {"a": -1}, {})
    with pytest.raises(ValueError, match="prefill"):
        wfq.dispatch_many(POOL, n=1, free_slots=1, free_kv_tokens=BIG, worker_id="w1",
                          running={"a": 1}, engine=bad)
    with pytest.raises(ValueError, match="kv_capacity"):
        wfq.dispatch_many(POOL, n=1, free_slots=1, free_kv_tokens=BIG, worker_id="w1",
                          running={"a": 1},
                          engine=EngineShares(PREFILL_CAP, float("nan"), {}, {}))
