"""Property tests of the WFQ dispatcher on real Redis: random interleavings against a model.

A hypothesis state machine drives enqueue, dispatch (with and without slot fairness), remove and
complete across tenants and two workers on a clock it advances, and compares every reply with a
small Python model of the design's rules. After every step it re-reads the raw Redis keys and
checks the invariants written in serving/lua/wfq/common.lua (H1-H7) and that each request is in
exactly one place.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field, replace

import pytest
from django.conf import settings as django_settings
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from infra.redis_conn import get_redis, pool_key
from serving.keys import inflight_key
from serving.wfq import EngineShares, Prices, QueueEntry, Wfq

POOL = "props"
PRICES = Prices(1.0, 2.0)
WEIGHTS = {"a": 1.0, "b": 2.0, "c": 0.5, "d": 3.0}
WORKERS = ("w1", "w2")
PRUNE = 128  # seen members dispatch prunes per call at most (serving/lua/wfq/dispatch.lua)


def units(weight: float) -> int:
    """A weight in integer units of 1e-6, as the scripts keep it (H7, lua/wfq/common.lua)."""
    return max(1, math.floor(weight * 1e6 + 0.5))


def assert_pool_consistent(client, pool: str, policy: str = "wfq") -> dict[str, list[str]]:
    """Check H1, H2 and H5 from the raw keys; returns each tenant's queued ids in FIFO order."""
    prefix = pool_key("wfq", pool, "q", "")
    queues: dict[str, list[QueueEntry]] = {}
    for qkey in client.scan_iter(match=prefix + "*", count=1000):
        tenant = qkey.decode()[len(prefix):]
        entries = [QueueEntry.unpack(e) for e in client.zrange(qkey, 0, -1)]
        assert entries, f"empty queue key left behind for {tenant}"
        assert all(e.tenant_id == tenant for e in entries)
        assert [e.seq for e in entries] == sorted(e.seq for e in entries)
        queues[tenant] = entries
    heads = {m.decode(): s for m, s in client.zrange(pool_key("wfq", pool, "heads"), 0, -1,
                                                     withscores=True)}
    shift = {k.decode(): float(v)
             for k, v in client.hgetall(pool_key("wfq", pool, "shift")).items()}
    assert set(heads) == set(queues), "H1: heads must list exactly the backlogged tenants"
    assert set(shift) <= set(queues), "H5: a shift is kept only for backlogged tenants"
    for tenant, entries in queues.items():
        want = entries[0].seq if policy == "fifo" else entries[0].tag + shift.get(tenant, 0.0)
        assert heads[tenant] == want, f"H1: {tenant}'s head score is stale"
    items = {k.decode(): QueueEntry.unpack(v)
             for k, v in client.hgetall(pool_key("wfq", pool, "items")).items()}
    queued = [e for entries in queues.values() for e in entries]
    assert sorted(items) == sorted(e.request_id for e in queued), "H2: items != queues"
    assert all(items[e.request_id] == e for e in queued)
    return {t: [e.request_id for e in entries] for t, entries in queues.items()}


def assert_active_consistent(client, pool: str, want: dict[str, int]) -> None:
    """H7 from the raw keys: active is exactly seen and heads scored by their weight units,
    and active_w is their sum."""
    active = {m.decode(): int(score) for m, score in
              client.zrange(pool_key("wfq", pool, "active"), 0, -1, withscores=True)}
    assert active == want, "H7: active != seen | heads"
    total = int(client.hget(pool_key("wfq", pool, "state"), "active_w") or 0)
    assert total == sum(want.values()), "H7: active_w != the sum of active"


@dataclass
class Model:
    """The design's rules in plain Python: what the scripts must reproduce.

    Queued entries keep raw tags; a tenant's effective tags are raw + off[tenant], so a
    correction moves a whole queue at once (the same representation as the scripts, so the
    floating-point results agree to the bit).
    """

    policy: str
    vtime: float = 0.0
    seq: int = 0
    last: dict[str, float] = field(default_factory=dict)
    off: dict[str, float] = field(default_factory=dict)
    queues: dict[str, list[QueueEntry]] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)  # tenant -> last enqueue time (H6)
    weight: dict[str, float] = field(default_factory=dict)

    def enqueue(self, tenant: str, rid: str, cost: float, kv: int, now: float = 0.0,
                weight: float | None = None) -> float:
        weight = WEIGHTS[tenant] if weight is None else weight
        self.seen[tenant], self.weight[tenant] = now, weight
        start = max(self.last.get(tenant, 0.0), self.vtime)
        finish = start + cost / weight
        off = self.off.get(tenant, 0.0)
        self.seq += 1
        raw = QueueEntry(rid, tenant, finish - off, start - off, self.vtime, cost, weight, kv,
                         self.seq)
        self.last[tenant] = finish
        self.queues.setdefault(tenant, []).append(raw)
        return finish

    def effective(self, raw: QueueEntry) -> QueueEntry:
        off = self.off.get(raw.tenant_id, 0.0)
        return replace(raw, tag=raw.tag + off, start_tag=raw.start_tag + off)

    def dispatch(self, n: int, budget: float, lookahead: int,
                 fair: tuple[Counter[str], int, float] | None = None,
                 engine: tuple[float, float, Counter[str], Counter[str]] | None = None,
                 ) -> list[QueueEntry]:
        """fair = (this worker's running counts, its free slots, now): rules S1-S3; engine =
        (prefill capacity, KV capacity, pending prefill and KV held per tenant): rule E."""
        allowed = lambda tenant, take=False, kv=0: True  # noqa: E731
        if fair is not None and self.policy == "wfq":
            allowed = self._slot_rules(*fair, engine=engine)
        out = []
        while len(out) < n:
            entry = self._pick(budget, lookahead, allowed)
            if entry is None:
                break
            self._drop(entry.tenant_id, 0)
            budget -= entry.kv_tokens
            self.vtime = max(self.vtime, entry.start_tag)
            out.append(entry)
            allowed(entry.tenant_id, take=True, kv=entry.kv_tokens)
        return out

    def prune(self, now: float) -> None:
        """Dispatch drops the PRUNE oldest seen members older than the window (H6)."""
        cutoff = now - django_settings.WFQ_ACTIVE_WINDOW_SECONDS
        expired = sorted((at, t.encode()) for t, at in self.seen.items() if at < cutoff)
        for _, t in expired[:PRUNE]:
            del self.seen[t.decode()]

    def active(self) -> dict[str, int]:
        """H7: the active zset, the tenants in seen or queued with their weight units."""
        queued = {t for t, q in self.queues.items() if q}
        return {t: units(self.weight[t]) for t in set(self.seen) | queued}

    def _slot_rules(self, running: Counter[str], free: int, now: float,
                    engine: tuple[float, float, Counter[str], Counter[str]] | None = None):
        """S1-S4 computed the slow way: every active tenant's cap, the whole unused sum; and
        E: every tenant's prefill and KV caps from the same weights."""
        fraction = min(1.0, django_settings.WFQ_SLOT_RESERVE)
        self.prune(now)
        run = Counter({t: c for t, c in running.items() if c > 0})
        slots = free + sum(run.values())
        active = set(run) | set(self.active())
        u = {t: units(self.weight.get(t, 1.0)) for t in active}
        total = sum(u.values())
        cap = {t: max(1, math.floor(slots * u[t] / total)) for t in active}
        reserve_max = math.floor(fraction * slots + 1e-9)
        state = {"free": free}

        def share(t: str) -> int:
            return max(0, cap.get(t, 1) - run[t])

        pend: Counter[str] = Counter()
        held: Counter[str] = Counter()
        if engine is not None:  # only tenants running here carry engine state
            pend.update({t: engine[2].get(t, 0) for t in run})
            held.update({t: engine[3].get(t, 0) for t in run})

        def engine_ok(t: str) -> bool:
            if engine is None or (pend[t] == 0 and held[t] == 0) or u[t] >= total:
                return True  # E1 nothing here; E2 alone
            return (pend[t] < max(1, math.floor(engine[0] * u[t] / total))
                    and held[t] < max(1, math.floor(engine[1] * u[t] / total)))

        def slot_ok(t: str) -> bool:
            if reserve_max == 0 or run[t] < cap.get(t, 1):
                return True
            if all(self.queues.get(j) for j in active):
                return True  # S4: everyone active is queued
            unused = sum(share(j) for j in active)
            return state["free"] - 1 >= min(unused - share(t), reserve_max)

        def allowed(t: str, take: bool = False, kv: int = 0) -> bool:
            if take:
                state["free"] -= 1
                run[t] += 1
                pend[t] += kv
                held[t] += kv
                return True
            return slot_ok(t) and engine_ok(t)

        allowed.nrun = lambda: sum(1 for c in run.values() if c > 0)  # type: ignore[attr-defined]
        return allowed

    def _pick(self, budget: float, lookahead: int, allowed) -> QueueEntry | None:
        heads = [self.effective(q[0]) for q in self.queues.values() if q]
        score = (lambda e: e.seq) if self.policy == "fifo" else (lambda e: e.tag)
        heads.sort(key=lambda e: (score(e), e.tenant_id.encode()))
        nrun = allowed.nrun() if hasattr(allowed, "nrun") else 0
        considered = 0
        for e in heads[: lookahead + nrun + 1]:
            if not allowed(e.tenant_id):
                continue
            if e.kv_tokens <= budget:
                return e
            considered += 1
            if considered > lookahead:
                return None
        return None

    def _drop(self, tenant: str, index: int) -> QueueEntry:
        raw = self.queues[tenant].pop(index)
        if not self.queues[tenant]:
            self.off.pop(tenant, None)
        return raw

    def remove(self, tenant: str, rid: str) -> None:
        index = [e.request_id for e in self.queues[tenant]].index(rid)
        raw = self._drop(tenant, index)
        if index == 0 and self.queues[tenant]:  # the head: the rest was tagged behind it
            self.shift_queue(tenant, -raw.cost / raw.weight)
        else:  # the ones ahead must not move; the next enqueue gets the credit
            self.move_last(tenant, -raw.cost / raw.weight)

    def complete(self, tenant: str, delta: float) -> float:
        if self.queues.get(tenant):
            return self.shift_queue(tenant, delta)
        return self.move_last(tenant, delta)

    def move_last(self, tenant: str, delta: float) -> float:
        """An idle tenant's credit stops at vtime."""
        self.last[tenant] = max(self.last.get(tenant, self.vtime) + delta, self.vtime)
        return self.last[tenant]

    def shift_queue(self, tenant: str, delta: float) -> float:
        """The whole queue moves; credit never starts the head before its arrival vtime, nor
        more than |delta| behind vtime."""
        cur = self.last.get(tenant, self.vtime)
        head, off = self.queues[tenant][0], self.off.get(tenant, 0.0)
        if delta < 0:
            floor = max(head.arrival_vtime, self.vtime + delta)
            delta = min(0, max(delta, floor - (head.start_tag + off)))
        if delta != 0:
            self.off[tenant] = off + delta
            self.last[tenant] = cur + delta
        return cur + delta


class WfqMachine(RuleBasedStateMachine):
    policy = "wfq"

    @initialize()
    def setup(self) -> None:
        self.client = get_redis()
        self.wfq = Wfq(self.client, policy=self.policy, prices=PRICES)
        self.wfq.reset(POOL)
        self.client.delete(*(inflight_key(POOL, w) for w in WORKERS))
        self.model = Model(self.policy)
        self.next_id = 0
        self.ids: list[str] = []
        self.inflight: dict[str, QueueEntry] = {}  # rid -> entry, with its worker below
        self.worker_of: dict[str, str] = {}
        self.done: set[str] = set()
        self.removed: set[str] = set()
        self.last_vtime = 0.0
        self.now = 1000.0

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 3.0, 6.0]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(tenant=st.sampled_from(sorted(WEIGHTS)), prompt=st.integers(0, 3000),
          max_out=st.integers(0, 1000), kv=st.integers(1, 4000))
    def enqueue(self, tenant: str, prompt: int, max_out: int, kv: int) -> None:
        self.next_id += 1
        rid = f"r{self.next_id}"
        tag = self.wfq.enqueue(POOL, tenant, rid, weight=WEIGHTS[tenant], prompt_tokens=prompt,
                               max_output_tokens=max_out, kv_tokens=kv, now=self.now)
        assert tag == self.model.enqueue(tenant, rid, PRICES.cost(prompt, max_out), kv,
                                         self.now)
        self.ids.append(rid)

    @rule(worker=st.sampled_from(WORKERS), n=st.integers(1, 4), slots=st.integers(0, 3),
          free_kv=st.integers(0, 8000), overcommit=st.sampled_from([1.0, 1.5]),
          lookahead=st.integers(0, 2))
    def dispatch(self, worker, n, slots, free_kv, overcommit, lookahead) -> None:
        got = self.wfq.dispatch_many(POOL, n=n, free_slots=slots, free_kv_tokens=free_kv,
                                     worker_id=worker, overcommit=overcommit,
                                     lookahead=lookahead)
        want = self.model.dispatch(min(n, slots), free_kv * overcommit, lookahead)
        self._took(worker, got, want)

    @rule(worker=st.sampled_from(WORKERS), n=st.integers(1, 6), free=st.integers(0, 4),
          free_kv=st.integers(0, 8000), lookahead=st.integers(0, 2),
          engine=st.none() | st.tuples(st.sampled_from([1, 500, 2000, 6000, 9000]),
                                       st.sampled_from([1, 1000, 4000, 8000, 12000])),
          prefilled=st.sampled_from([0.0, 0.3, 1.0]))
    def dispatch_fair(self, worker, n, free, free_kv, lookahead, engine, prefilled) -> None:
        """Slot fairness: the worker passes its own per-tenant running counts (S1-S3), and
        sometimes its engine's state (rule E): capacities, and per tenant the KV it holds and
        the prompt tokens still to prefill (a drawn fraction of each request's kv_tokens)."""
        mine = [self.inflight[r] for r in self.inflight if self.worker_of[r] == worker]
        running = Counter(e.tenant_id for e in mine)
        shares, model_engine = None, None
        if engine is not None:
            held = Counter()
            pend = Counter()
            for e in mine:
                held[e.tenant_id] += e.kv_tokens
                pend[e.tenant_id] += int(e.kv_tokens * prefilled)
            shares = EngineShares(float(engine[0]), float(engine[1]), dict(pend), dict(held))
            model_engine = (float(engine[0]), float(engine[1]), pend, held)
        got = self.wfq.dispatch_many(POOL, n=n, free_slots=free, free_kv_tokens=free_kv,
                                     worker_id=worker, lookahead=lookahead,
                                     running=dict(running), now=self.now, engine=shares)
        want = self.model.dispatch(min(n, free), free_kv, lookahead, (running, free, self.now),
                                   model_engine)
        self._took(worker, got, want)

    def _took(self, worker: str, got, want) -> None:
        assert [(g.request_id, g.tag, g.start_tag) for g in got] == [
            (w.request_id, w.tag, w.start_tag) for w in want]
        for item in got:
            assert item.request_id not in self.inflight and item.request_id not in self.done
            self.inflight[item.request_id] = item
            self.worker_of[item.request_id] = worker

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), wrong_tenant=st.booleans())
    def remove(self, data, wrong_tenant: bool) -> None:
        rid = data.draw(st.sampled_from(self.ids))
        entry = next((e for q in self.model.queues.values() for e in q if e.request_id == rid),
                     None)
        tenant = entry.tenant_id if entry else "a"
        if wrong_tenant:
            tenant = "b" if tenant == "a" else "a"
        removed = self.wfq.remove(POOL, tenant, rid)
        expected = entry is not None and entry.tenant_id == tenant
        assert removed == expected
        if removed:
            self.model.remove(tenant, rid)
            self.removed.add(rid)

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), used=st.floats(0.0, 1.0), twice=st.booleans())
    def complete(self, data, used: float, twice: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.inflight)))
        item, worker = self.inflight.pop(rid), self.worker_of[rid]
        actual = item.cost * used
        kwargs = dict(estimated_cost=item.cost, actual_cost=actual, weight=item.weight,
                      request_id=rid, worker_id=worker)
        new_last = self.wfq.complete(POOL, item.tenant_id, **kwargs)
        assert new_last == self.model.complete(item.tenant_id, (actual - item.cost) / item.weight)
        if twice:  # a retried completion must not refund again
            assert self.wfq.complete(POOL, item.tenant_id, **kwargs) is None
        self.done.add(rid)

    @invariant()
    def queues_consistent(self) -> None:
        if not hasattr(self, "model"):
            return
        queued = assert_pool_consistent(self.client, POOL, self.policy)
        assert queued == {t: [e.request_id for e in q] for t, q in self.model.queues.items() if q}
        want = [self.model.effective(e) for q in self.model.queues.values() for e in q]
        assert self.wfq.queued_requests(POOL) == sorted(want, key=lambda e: e.seq)
        last = self.client.hgetall(pool_key("wfq", POOL, "last"))
        assert {k.decode(): float(v) for k, v in last.items()} == self.model.last
        seen = self.client.zrange(pool_key("wfq", POOL, "seen"), 0, -1, withscores=True)
        assert {m.decode(): at for m, at in seen} == self.model.seen, "H6: seen"
        weight = self.client.hgetall(pool_key("wfq", POOL, "weight"))
        assert {k.decode(): float(v) for k, v in weight.items()} == self.model.weight
        assert_active_consistent(self.client, POOL, self.model.active())

    @invariant()
    def each_request_in_exactly_one_place(self) -> None:
        if not hasattr(self, "model"):
            return
        queued = {e.request_id for q in self.model.queues.values() for e in q}
        running = {w: {m.decode() for m in self.client.smembers(inflight_key(POOL, w))}
                   for w in WORKERS}
        assert running["w1"].isdisjoint(running["w2"])
        assert running["w1"] | running["w2"] == set(self.inflight)
        places = [queued, set(self.inflight), self.done, self.removed]
        assert sum(len(p) for p in places) == len(self.ids)
        assert set().union(*places) == set(self.ids)

    @invariant()
    def vtime_never_decreases(self) -> None:
        if not hasattr(self, "model"):
            return
        vtime = self.wfq.vtime(POOL)
        assert vtime >= self.last_vtime
        assert vtime == self.model.vtime
        self.last_vtime = vtime


class FifoMachine(WfqMachine):
    policy = "fifo"


# WFQ_PROPERTY_EXAMPLES=500 for a longer hunt; the default keeps the suite fast.
_settings = settings(max_examples=int(os.environ.get("WFQ_PROPERTY_EXAMPLES", "30")),
                     stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.usefixtures("redis_client")
class TestWfqStateMachine(WfqMachine.TestCase):
    settings = _settings


@pytest.mark.usefixtures("redis_client")
class TestFifoStateMachine(FifoMachine.TestCase):
    settings = _settings
