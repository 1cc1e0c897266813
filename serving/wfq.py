"""Per-tenant queues and the weighted-fair-queueing dispatcher of a pool, in Redis.

Admitted requests wait in one queue per tenant and pool. A worker with free capacity asks the
dispatcher for work and gets the queued request with the smallest virtual finish tag
(Demers, Keshav and Shenker, SIGCOMM 1989):

    finish = max(tenant's last tag, vtime) + cost / weight
    vtime  = max(vtime, start tag of the request entering service)

Cost is counted in tokens with prices for input and output, as in Sheng et al.'s virtual token
counter (OSDI 2024): ``WFQ_INPUT_PRICE * prompt + WFQ_OUTPUT_PRICE * max_output``. The
estimate is corrected with the actual output when the request ends (:meth:`Wfq.complete`):
the tenant's queued requests move up by the overcharge, bounded so that refunds never turn
into credit a tenant can bank ahead of the others (tests/test_wfq.py measures both sides).

Every operation is one Lua script in ``serving/lua/wfq/`` (the key layout and invariants are
written there), so any number of gateway and worker processes can enqueue and dispatch at
once: a request is never dispatched twice and never lost (see docs/adr/0001). ``AsyncWfq`` is
the serving path's (the gateway's cancels, the worker's dispatch); admission queues through
``enter.lua`` and settlement corrects tags in ``settle.lua``, both including the same prelude.
``Wfq`` runs the same scripts on a sync client for the janitor's removals, the pool status's
backlog, tools and simulations; both share the argument building and reply parsing below.

Slot fairness (``dispatch_many(..., running=...)``, docs/adr/0006): a dispatched sequence holds
its slot until it ends, so a worker that passes its per-tenant running counts gets at most a
tenant's weighted share of its slots for that tenant while other tenants are active (queued,
running there, or enqueued within ``WFQ_ACTIVE_WINDOW_SECONDS``), unless enough slots stay free
for the others' unused shares (at most ``WFQ_SLOT_RESERVE`` of the slots); a lone tenant gets
every slot. The rules are written in ``serving/lua/wfq/dispatch.lua``.

Engine shares (``dispatch_many(..., running=..., engine=EngineShares(...))``, docs/adr/0017):
slots are not the engine's unit of work, so a worker that also passes its engine's state (its
prefill and KV capacity, and per tenant the prompt tokens it has not yet prefilled and the KV
tokens it holds) gets at most a tenant's weighted share of the prefill budget and of the KV
cache for that tenant while others are active (rule E in dispatch.lua); a lone tenant gets all.

``policy="fifo"`` orders by arrival instead of tag through the same scripts, so benchmarks
compare the two policies through the same code; it ignores slot fairness. The policy belongs
to the pool: the enqueuer's setting is stored with it (and may change only while the pool is
empty); dispatch and remove follow the stored one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache, cached_property, lru_cache
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings

from infra.keyspace import WFQ_PARTS, wfq_key, wfq_queue_prefix
from infra.loop_local import LoopLocal
from infra.redis_conn import get_async_redis, get_redis
from serving.keys import inflight_key, req_key
from serving.lua import source as lua_source

POLICIES = ("wfq", "fifo")
_SEP = "|"  # field separator inside a packed queue entry (see serving/lua/wfq/common.lua)
_ID = re.compile(r"[^\s|]{1,200}")
# No ':' so a pool's keys never collide with another's; no braces, which would end its hash tag.
_POOL = re.compile(r"[^\s|:{}]{1,200}")


class WfqError(RuntimeError):
    """A script refused an operation (duplicate id, policy mismatch)."""


class DuplicateRequest(WfqError):
    """The request id is already queued in this pool."""


class PolicyMismatch(WfqError):
    """The pool holds requests queued under the other policy; it switches once drained."""


@dataclass(frozen=True)
class Prices:
    """Cost per token, the virtual token counter's input and output weights, plus KV memory.

    ``kv`` prices KV memory held over time, per token of context per decode step: a request's
    context grows from ``prompt`` to ``prompt + output`` over its ``output`` decode steps, so it
    holds ``output * (prompt + output / 2)`` token-steps ("context length times duration",
    docs/adr/0017). Duration is counted in the request's own decode steps, not seconds, so a
    tenant is not charged more because the pool was busy; the estimate uses max_tokens and
    settlement corrects it with the actual output, as for the other terms.
    """

    input: float
    output: float
    kv: float = 0.0

    @classmethod
    def from_settings(cls) -> Prices:
        return cls(settings.WFQ_INPUT_PRICE, settings.WFQ_OUTPUT_PRICE, settings.WFQ_KV_PRICE)

    def cost(self, prompt_tokens: int, output_tokens: int) -> float:
        cost = self.input * prompt_tokens + self.output * output_tokens
        if self.kv:
            cost += self.kv * output_tokens * (prompt_tokens + output_tokens / 2)
        return cost


@dataclass(frozen=True)
class EngineShares:
    """A worker's engine state for the dispatcher's prefill and KV shares (rule E).

    ``prefill_capacity``: prompt tokens the engine computes over the dispatch horizon
    (``prefill_tokens_per_s * WFQ_PREFILL_HORIZON_SECONDS``); ``kv_capacity``: its KV cache
    in tokens. ``prefill`` and ``kv``: per tenant running here, its prompt tokens not yet
    prefilled and its KV tokens held (tenants not in ``running`` are ignored).
    """

    prefill_capacity: float
    kv_capacity: float
    prefill: Mapping[str, int]
    kv: Mapping[str, int]


@dataclass(frozen=True)
class QueueEntry:
    """A queued request as the scripts pack it: what dispatch and complete need."""

    request_id: str
    tenant_id: str
    tag: float  # virtual finish tag
    start_tag: float  # max(tenant's last tag, vtime) at enqueue, moved by corrections
    arrival_vtime: float  # the pool's vtime at enqueue: corrections never start it earlier
    cost: float  # estimated cost, to pass back to complete()
    weight: float
    kv_tokens: int
    seq: int  # arrival order in the pool

    @classmethod
    def unpack(cls, entry: bytes | str) -> QueueEntry:
        text = entry.decode() if isinstance(entry, bytes) else entry
        finish, start, arrival, cost, weight, kv, seq, tenant, rid = text.split(_SEP, 8)
        return cls(rid, tenant, float(finish), float(start), float(arrival), float(cost),
                   float(weight), int(float(kv)), int(seq))


@dataclass(frozen=True)
class DispatchedItem(QueueEntry):
    """A request the dispatcher moved into a worker's in-flight set.

    Dispatched with ``claim`` (dispatch.lua K1, K2), the same step claimed it: ``payload`` is
    its transit payload and ``cancel_reason`` a cancel that came first, or ``claimed`` is False
    when it was settled while queued (it is in no in-flight set: do not run it).
    """

    worker_id: str = ""
    claimed: bool = True
    cancel_reason: str = ""
    payload: Mapping[str, bytes] | None = None


@dataclass(frozen=True)
class Keys:
    """Redis keys of one pool (layout in serving/lua/wfq/common.lua and docs/architecture.md)."""

    pool: str

    def __post_init__(self) -> None:
        _check(_POOL, "pool", self.pool)

    def part(self, name: str) -> str:
        return wfq_key(self.pool, name)

    @cached_property
    def qprefix(self) -> str:
        # Queue keys are built from this prefix inside the scripts: the pool's tag makes them
        # hash to the pool's slot like the declared keys (Redis Cluster routes a script by its
        # declared keys; an undeclared key on the same slot is allowed).
        return wfq_queue_prefix(self.pool)

    def queue(self, tenant_id: str) -> str:
        return self.qprefix + tenant_id

    @cached_property
    def common(self) -> tuple[str, ...]:
        # Every script gets these first, in this order (serving/lua/wfq/common.lua).
        return tuple(self.part(name) for name in WFQ_PARTS)


def pool_keys(pool: str) -> Keys:
    """The pool's WFQ keys (settle.lua corrects a tenant's tags through them)."""
    return _keys(pool)


def _keys(pool: str) -> Keys:
    # Building keys is a measurable share of a dispatch round trip, and pools are few. The
    # prefix is part of the cache key so a settings override still applies.
    return _cached_keys(settings.REDIS_KEY_PREFIX, pool)


@lru_cache(maxsize=1024)
def _cached_keys(prefix: str, pool: str) -> Keys:
    return Keys(pool)


def _check(pattern: re.Pattern[str], what: str, value: str) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"{what} must be 1-200 characters without whitespace or '|'")


def _number(what: str, value: float, *, positive: bool = False) -> str:
    if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0")
    if positive and value <= 0:
        raise ValueError(f"{what} must be > 0")
    return repr(float(value))


@cache
def _source(name: str) -> str:
    return lua_source("wfq/common.lua", f"wfq/{name}.lua")


_SCRIPTS = ("enqueue", "dispatch", "remove", "complete", "backlog", "queued", "reset")


# --- argument building, shared by the sync and async clients -------------------------------

Call = tuple[list[str], list[str]]


def _now(now: float | None) -> str:
    # '' lets the script read the Redis server's clock, the same for every process.
    return "" if now is None else _number("now", now)


def _enqueue_call(keys: Keys, policy: str, prices: Prices, tenant_id: str, request_id: str,
                  weight: float, prompt_tokens: int, max_output_tokens: int,
                  kv_tokens: int, now: float | None = None) -> Call:
    _check(_ID, "tenant_id", tenant_id)
    _check(_ID, "request_id", request_id)
    _number("prompt_tokens", prompt_tokens)
    _number("max_output_tokens", max_output_tokens)
    cost = _number("cost", prices.cost(prompt_tokens, max_output_tokens))
    args = [policy, tenant_id, request_id, cost, _number("weight", weight, positive=True),
            _number("kv_tokens", kv_tokens), _now(now)]
    return [*keys.common, keys.queue(tenant_id)], args


def enqueue_call(pool: str, policy: str, tenant_id: str, request_id: str, *, weight: float,
                 prompt_tokens: int, max_output_tokens: int, kv_tokens: int,
                 now: float | None = None, prices: Prices | None = None) -> Call:
    """enqueue.lua's keys and arguments, which admission's ``enter.lua`` takes as its own."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}")
    return _enqueue_call(_keys(pool), policy, prices or Prices.from_settings(), tenant_id,
                         request_id, weight, prompt_tokens, max_output_tokens, kv_tokens, now)


def _dispatch_call(keys: Keys, n: int, free_slots: int, free_kv_tokens: float,
                   overcommit: float, worker_id: str, lookahead: int,
                   running: Mapping[str, int] | None = None, now: float | None = None,
                   engine: EngineShares | None = None, claim: Sequence[str] = ()) -> Call:
    _check(_ID, "worker_id", worker_id)
    if n < 0 or free_slots < 0 or lookahead < 0:
        raise ValueError("n, free_slots and lookahead must be >= 0")
    budget = float(_number("free_kv_tokens", free_kv_tokens)) * float(
        _number("overcommit", overcommit, positive=True))
    args = [keys.qprefix, str(min(n, free_slots)), repr(budget), str(lookahead),
            "0" if running is None else "1", str(free_slots), _now(now),
            _number("WFQ_ACTIVE_WINDOW_SECONDS", settings.WFQ_ACTIVE_WINDOW_SECONDS),
            _number("WFQ_SLOT_RESERVE", min(1.0, settings.WFQ_SLOT_RESERVE)),
            *_running_args(running)]
    if engine is not None and running is not None:
        args += _engine_args(engine, args[-2])
    if claim:  # dispatch.lua's ARGV[18..]: rule E's four are '' when it is off
        args += [""] * (17 - len(args)) + [req_key(keys.pool, ""), worker_id, *claim]
    return [*keys.common, inflight_key(keys.pool, worker_id)], args


def _running_args(running: Mapping[str, int] | None) -> list[str]:
    # The number of tenants running here, the sum of their counts, their ids and their counts
    # (counts > 0), each list as one space-separated argument, as dispatch.lua reads them: a
    # worker passes up to one tenant per slot on every call, and 2 arguments instead of 2 per
    # tenant keep the call cheap to build, send and read.
    if not running:
        return ["0", "0", "", ""]
    try:
        ids = " ".join(running)
    except TypeError:
        ids = ""
    # As _ID for each id, cheaper than a regex over ids: split() cuts at any whitespace and
    # drops empty pieces, so it yields one piece per id only if none is empty or has a space.
    if (len(ids.split()) != len(running) or "|" in ids
            or (len(ids) > 200 and max(map(len, running)) > 200)):
        raise ValueError("running tenant_id must be 1-200 characters without whitespace or '|'")
    counts = list(running.values())
    try:  # _NUM[c] takes only ints (bool is one) and the lookup beats str(c)
        text = " ".join(map(_NUM.__getitem__, counts)) if min(counts) >= 0 else None
    except (TypeError, IndexError):
        text = " ".join(map(str, counts)) if all(isinstance(c, int) and c >= 0
                                                 for c in counts) else None
    if text is None:
        raise ValueError("running counts must be ints >= 0")
    if 0 in counts:
        ids = " ".join(t for t, c in zip(running, counts, strict=True) if c)
        counts = [c for c in counts if c]
        text = " ".join(map(str, counts))
    return [str(len(counts)), str(sum(counts)), ids, text]


_NUM = tuple(str(i) for i in range(1025))


def _engine_args(engine: EngineShares, ids: str) -> list[str]:
    # Rule E's arguments: the capacities, then the pending prefill and KV held of each tenant
    # in the running ids (the same order, so one list each, as for the counts).
    tenants = ids.split()
    lists = []
    for what, per in (("prefill", engine.prefill), ("kv", engine.kv)):
        values = [per.get(t, 0) for t in tenants]
        if not all(isinstance(v, int) and v >= 0 for v in values):
            raise ValueError(f"engine {what} tokens must be ints >= 0")
        lists.append(" ".join(map(str, values)))
    return [_number("prefill_capacity", engine.prefill_capacity),
            _number("kv_capacity", engine.kv_capacity), *lists]


def _remove_call(keys: Keys, tenant_id: str, request_id: str) -> Call:
    _check(_ID, "tenant_id", tenant_id)
    _check(_ID, "request_id", request_id)
    return [*keys.common, keys.queue(tenant_id)], [tenant_id, request_id]


def _complete_call(keys: Keys, tenant_id: str, estimated_cost: float, actual_cost: float,
                   weight: float, request_id: str | None, worker_id: str | None) -> Call:
    _check(_ID, "tenant_id", tenant_id)
    if (request_id is None) != (worker_id is None):
        raise ValueError("pass request_id and worker_id together, or neither")
    inflight = (inflight_key(keys.pool, worker_id) if worker_id is not None
                else keys.part("no-inflight"))
    args = [tenant_id, _number("estimated_cost", estimated_cost),
            _number("actual_cost", actual_cost), _number("weight", weight, positive=True),
            request_id or ""]
    return [*keys.common, keys.queue(tenant_id), inflight], args


# --- reply parsing -------------------------------------------------------------------------


class Dispatched(list[DispatchedItem]):
    """What one dispatch moved, and whether requests were left queued in the pool (``more``:
    some tenant still has one; a worker given fewer than it asked for then has a head that did
    not fit, and looks again when its own slots or KV free up)."""

    more: bool = False


def _dispatched(reply: Sequence[Any], worker_id: str,
                claim: Sequence[str] = ()) -> Dispatched:
    # reply[0] is {the pool's vtime after the dispatch, tenants still queued}; the entries
    # follow, each followed by its claim when claiming.
    out = Dispatched()
    out.more = int(reply[0][1]) > 0
    if not claim:
        out.extend(DispatchedItem(**vars(QueueEntry.unpack(e)), worker_id=worker_id)
                   for e in reply[1:])
        return out
    for entry, got in zip(reply[1::2], reply[2::2], strict=True):
        ok = int(got[0]) == 1
        out.append(DispatchedItem(
            **vars(QueueEntry.unpack(entry)), worker_id=worker_id, claimed=ok,
            cancel_reason=got[1].decode() if ok else "",
            payload=dict(zip(claim, got[2:], strict=True)) if ok else None))
    return out


def _backlog(reply: Sequence[Any]) -> dict[str, int]:
    return {reply[i].decode(): int(reply[i + 1]) for i in range(0, len(reply), 2)}


def _queued(entries: Sequence[bytes]) -> list[QueueEntry]:
    return sorted((QueueEntry.unpack(e) for e in entries), key=lambda e: e.seq)


def raise_script_error(exc: redis.ResponseError) -> None:
    """The WFQ error a script's reply names, or the reply's own."""
    text = str(exc)
    if "WFQDUP" in text:
        raise DuplicateRequest(text) from exc
    if "WFQPOLICY" in text:
        raise PolicyMismatch(text) from exc
    if "WFQARG" in text:
        raise ValueError(text) from exc
    raise exc


class _Base:
    def __init__(self, client: Any, policy: str, prices: Prices | None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        self.client, self.policy, self._prices = client, policy, prices
        self._scripts = {name: client.register_script(_source(name)) for name in _SCRIPTS}

    @property
    def prices(self) -> Prices:
        # Read per call so a settings change (or a test override) applies without a restart.
        return self._prices or Prices.from_settings()


class Wfq(_Base):
    """The dispatcher on a sync redis-py client (Django views, Celery, management commands)."""

    def __init__(self, client: redis.Redis | None = None, *, policy: str = "wfq",
                 prices: Prices | None = None) -> None:
        super().__init__(client or get_redis(), policy, prices)

    def _run(self, name: str, call: Call) -> Any:
        try:
            return self._scripts[name](keys=call[0], args=call[1])
        except redis.ResponseError as exc:
            raise_script_error(exc)

    def enqueue(self, pool: str, tenant_id: str, request_id: str, *, weight: float,
                prompt_tokens: int, max_output_tokens: int, kv_tokens: int,
                now: float | None = None) -> float:
        """Queue a request; returns its finish tag. Raises DuplicateRequest if already queued.

        ``now`` (seconds) stamps the tenant as active for slot fairness; None uses the Redis
        server's clock. Pass it only when every caller of the pool does (a virtual clock).
        """
        call = _enqueue_call(_keys(pool), self.policy, self.prices, tenant_id, request_id,
                             weight, prompt_tokens, max_output_tokens, kv_tokens, now)
        return float(self._run("enqueue", call))

    def dispatch_many(self, pool: str, *, n: int, free_slots: int, free_kv_tokens: float,
                      worker_id: str, overcommit: float = 1.0, lookahead: int = 0,
                      running: Mapping[str, int] | None = None,
                      now: float | None = None,
                      engine: EngineShares | None = None) -> Dispatched:
        """Move up to n requests, smallest tag first, into worker_id's free capacity.

        ``running`` is the worker's own sequences per tenant (all of them, so that free_slots
        + their sum is its slot count); passing it turns on slot fairness under "wfq" (module
        docstring), and ``engine`` with it the prefill and KV shares. ``now`` as for
        :meth:`enqueue`.
        """
        call = _dispatch_call(_keys(pool), n, free_slots, free_kv_tokens,
                              overcommit, worker_id, lookahead, running, now, engine)
        return _dispatched(self._run("dispatch", call), worker_id)

    def dispatch(self, pool: str, *, free_slots: int, free_kv_tokens: float, worker_id: str,
                 overcommit: float = 1.0, lookahead: int = 0,
                 running: Mapping[str, int] | None = None,
                 now: float | None = None,
                 engine: EngineShares | None = None) -> DispatchedItem | None:
        """The next request if it fits (a free slot, kv_tokens <= free x overcommit), else None."""
        items = self.dispatch_many(pool, n=1, free_slots=free_slots,
                                   free_kv_tokens=free_kv_tokens, worker_id=worker_id,
                                   overcommit=overcommit, lookahead=lookahead,
                                   running=running, now=now, engine=engine)
        return items[0] if items else None

    def remove(self, pool: str, tenant_id: str, request_id: str) -> bool:
        """Drop a still-queued request of this tenant; False if it is not queued."""
        return bool(self._run("remove", _remove_call(_keys(pool), tenant_id, request_id)) == 1)

    def complete(self, pool: str, tenant_id: str, *, estimated_cost: float, actual_cost: float,
                 weight: float, request_id: str | None = None,
                 worker_id: str | None = None) -> float | None:
        """Move the tenant in virtual time by (actual - estimated) / weight.

        Its queued requests (all queued behind this one) and its last tag move together, as if
        the estimate had been exact. Credit never starts the head before the vtime it arrived
        at, nor more than this credit behind the current vtime, so refunds of requests that ran
        in parallel cannot pile up; with nothing queued, the next enqueue gets the credit, not
        below vtime (shift_queue and move_last in serving/lua/wfq/common.lua).
        With request_id and worker_id, the same script removes the id from the worker's
        in-flight set and corrects only if it was there, so a retried call corrects once.
        Returns the new last tag, or None when that correction had already happened.
        """
        call = _complete_call(_keys(pool), tenant_id, estimated_cost, actual_cost, weight,
                              request_id, worker_id)
        reply = self._run("complete", call)
        return None if reply is None else float(reply)

    def backlog(self, pool: str) -> dict[str, int]:
        keys = _keys(pool)
        return _backlog(self._run("backlog", (list(keys.common), [keys.qprefix])))

    def queued_requests(self, pool: str) -> list[QueueEntry]:
        """Every queued request of the pool with its current tags, in arrival order."""
        return _queued(self._run("queued", (list(_keys(pool).common), [])))

    def vtime(self, pool: str) -> float:
        return float(self.client.hget(_keys(pool).part("state"), "vtime") or 0)

    def reset(self, pool: str) -> None:
        """Delete every key of the pool, its policy included (tests, benchmarks)."""
        keys = _keys(pool)
        self._run("reset", (list(keys.common), [keys.qprefix]))


class AsyncWfq(_Base):
    """The same dispatcher on an asyncio client (the ASGI gateway, async worker loops)."""

    def __init__(self, client: aioredis.Redis | None = None, *, policy: str = "wfq",
                 prices: Prices | None = None) -> None:
        super().__init__(client or get_async_redis(), policy, prices)

    async def _run(self, name: str, call: Call) -> Any:
        try:
            return await self._scripts[name](keys=call[0], args=call[1])
        except redis.ResponseError as exc:
            raise_script_error(exc)

    async def enqueue(self, pool: str, tenant_id: str, request_id: str, *, weight: float,
                      prompt_tokens: int, max_output_tokens: int, kv_tokens: int,
                      now: float | None = None) -> float:
        call = _enqueue_call(_keys(pool), self.policy, self.prices, tenant_id, request_id,
                             weight, prompt_tokens, max_output_tokens, kv_tokens, now)
        return float(await self._run("enqueue", call))

    async def dispatch_many(self, pool: str, *, n: int, free_slots: int,
                            free_kv_tokens: float, worker_id: str, overcommit: float = 1.0,
                            lookahead: int = 0, running: Mapping[str, int] | None = None,
                            now: float | None = None, engine: EngineShares | None = None,
                            claim: Sequence[str] = ()) -> Dispatched:
        """As :meth:`Wfq.dispatch_many`; with ``claim`` (the transit payload's fields) the same
        script claims each request it pops (dispatch.lua K1, K2: the worker's one round trip)."""
        call = _dispatch_call(_keys(pool), n, free_slots, free_kv_tokens,
                              overcommit, worker_id, lookahead, running, now, engine, claim)
        return _dispatched(await self._run("dispatch", call), worker_id, claim)

    async def dispatch(self, pool: str, *, free_slots: int, free_kv_tokens: float,
                       worker_id: str, overcommit: float = 1.0, lookahead: int = 0,
                       running: Mapping[str, int] | None = None,
                       now: float | None = None,
                       engine: EngineShares | None = None) -> DispatchedItem | None:
        items = await self.dispatch_many(pool, n=1, free_slots=free_slots,
                                         free_kv_tokens=free_kv_tokens, worker_id=worker_id,
                                         overcommit=overcommit, lookahead=lookahead,
                                         running=running, now=now, engine=engine)
        return items[0] if items else None

    async def remove(self, pool: str, tenant_id: str, request_id: str) -> bool:
        call = _remove_call(_keys(pool), tenant_id, request_id)
        return bool(await self._run("remove", call) == 1)

    async def complete(self, pool: str, tenant_id: str, *, estimated_cost: float,
                       actual_cost: float, weight: float, request_id: str | None = None,
                       worker_id: str | None = None) -> float | None:
        call = _complete_call(_keys(pool), tenant_id, estimated_cost, actual_cost, weight,
                              request_id, worker_id)
        reply = await self._run("complete", call)
        return None if reply is None else float(reply)

    async def backlog(self, pool: str) -> dict[str, int]:
        keys = _keys(pool)
        return _backlog(await self._run("backlog", (list(keys.common), [keys.qprefix])))

    async def queued_requests(self, pool: str) -> list[QueueEntry]:
        return _queued(await self._run("queued", (list(_keys(pool).common), [])))

    async def vtime(self, pool: str) -> float:
        return float(await self.client.hget(_keys(pool).part("state"), "vtime") or 0)

    async def reset(self, pool: str) -> None:
        keys = _keys(pool)
        await self._run("reset", (list(keys.common), [keys.qprefix]))


_async_wfqs: LoopLocal[AsyncWfq] = LoopLocal(lambda: AsyncWfq(policy=settings.WFQ_POLICY))


def for_loop() -> AsyncWfq:
    """This event loop's ``AsyncWfq`` (policy ``WFQ_POLICY``, prices read from settings)."""
    return _async_wfqs.get()
