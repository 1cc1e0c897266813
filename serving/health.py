"""Per-pool health: a circuit breaker shared by every gateway, in Redis (docs/adr: routes).

A pool's breaker is one hash on the pool's slot, changed only by ``serving/lua/breaker.lua``
(its invariants B1-B4 are written there):

- **closed**: requests go to the pool. ``BREAKER_FAILURES`` consecutive retryable failures
  before the first token (worker lost, engine or upstream error, first-token deadline) open it;
- **open**: no request is sent there for ``BREAKER_COOLDOWN_SECONDS``;
- **half_open**: then one request (a probe) is let through per ``BREAKER_PROBE_SECONDS``; its
  success closes the breaker, its failure opens it again.

A pool with **no live worker** (no heartbeat within ``WORKER_DEAD_AFTER_SECONDS``) is refused by
the same call that asks, whatever the state: nothing is queued where nobody will take it, and
the request goes to another target or is refused at once, naming the model (issue 28: a pool
whose worker cannot start made requests wait out the 30 s first-token deadline).

This is the one place that says whether a pool can serve now; the model listing and the
router both ask it (``usable``), so a model is listed only while one of its pools can.

A gateway tells the breaker each request's outcome before its first token (``note``) without
the response waiting for it, and writes a pool's successes at most once per
``SUCCESS_EVERY_S`` per event loop: the first at once, the ones after it within that time as
one write at its end (a success only resets the count, so one stands for all of them). A
failure is written at once, after the success still waiting (this process's order is kept).
On a healthy pool that is one breaker round trip per ``SUCCESS_EVERY_S`` instead of one per
request (issue 30); a success reaches Redis at most that much later.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from infra.loop_local import LoopLocal
from infra.pool_workers import queue_live_count, workers_key
from infra.redis_conn import get_async_redis, pool_key
from serving.lua import script

# Failures the client never caused and another pool may not have: they count against the pool.
POOL_FAILURES = frozenset({
    "worker_lost", "worker_error", "worker_shutdown", "engine_error", "engine_stopped",
    "engine_restarting", "stream_broken", "ttft_deadline_exceeded", "upstream_error",
})


@dataclass(frozen=True)
class Verdict:
    pool: str
    allowed: bool
    state: str  # closed | open | half_open
    reason: str  # "" | failures | no_worker


def breaker_key(pool: str) -> str:
    return pool_key("breaker", pool)


def _args(op: str, now: float | None) -> list[object]:
    now = time.time() if now is None else now
    return [op, repr(now), repr(now - settings.WORKER_DEAD_AFTER_SECONDS),
            settings.BREAKER_FAILURES, repr(settings.BREAKER_COOLDOWN_SECONDS),
            repr(settings.BREAKER_PROBE_SECONDS)]


def _keys(pool: str) -> list[str]:
    return [breaker_key(pool), workers_key(pool)]


def _verdict(pool: str, raw: Sequence[object]) -> Verdict:
    def s(v: object) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    return Verdict(pool, int(str(raw[0])) == 1, s(raw[1]), s(raw[2]))


async def check(pools: Iterable[str], now: float | None = None) -> list[Verdict]:
    """One breaker decision per pool (a half-open pool hands out its probe to this caller).

    One pipelined round trip; each script touches one pool's slot only.
    """
    names = list(pools)
    if not names:
        return []
    pipe = get_async_redis().pipeline(transaction=False)
    queue_checks(pipe, names, now)
    return verdicts(names, await pipe.execute())


def queue_checks(pipe: Any, pools: Sequence[str], now: float | None = None) -> None:
    """Add one breaker decision per pool to a pipeline (read them back with ``verdicts``), so
    a caller can ask in the same round trip as its own reads."""
    lua = script("breaker")
    for name in pools:
        lua.queue(pipe, _keys(name), _args("allow", now))


def verdicts(pools: Sequence[str], replies: Sequence[Any]) -> list[Verdict]:
    return [_verdict(n, raw) for n, raw in zip(pools, replies, strict=True)]


async def record(pool: str, ok: bool, now: float | None = None) -> Verdict:
    """The outcome of a request before its first token: ``ok`` (a token came) or a failure."""
    raw = await script("breaker").run_async(get_async_redis(), _keys(pool),
                                            _args("success" if ok else "failure", now))
    return _verdict(pool, raw)


SUCCESS_EVERY_S = 0.05  # a pool's successes: at most one breaker write per this, per loop


class _Outcomes:
    """One event loop's outcomes on their way to the breakers (see the module docstring)."""

    def __init__(self) -> None:
        self.written: dict[str, float] = {}  # pool -> loop time its last success was sent
        self.waiting: set[str] = set()  # pools with a success not sent yet
        self.tasks: set[asyncio.Task[None]] = set()

    def note(self, pool: str, ok: bool) -> None:
        loop = asyncio.get_running_loop()
        if not ok:
            self._spawn(self._failure(pool, pool in self.waiting))
            self.waiting.discard(pool)
            return
        if pool in self.waiting:
            return  # the write already waiting stands for this success too
        now = loop.time()
        last = self.written.get(pool)
        if last is None or now - last >= SUCCESS_EVERY_S:
            self._send_success(pool, now)
            return
        self.waiting.add(pool)
        loop.call_at(last + SUCCESS_EVERY_S, self._flush, pool)

    def _flush(self, pool: str) -> None:
        if pool in self.waiting:  # not sent meanwhile ahead of a failure
            self.waiting.discard(pool)
            self._send_success(pool, asyncio.get_running_loop().time())

    def _send_success(self, pool: str, now: float) -> None:
        self.written[pool] = now
        self._spawn(self._write(pool, True))

    async def _failure(self, pool: str, success_first: bool) -> None:
        if success_first:
            await self._write(pool, True)
        await self._write(pool, False)

    @staticmethod
    async def _write(pool: str, ok: bool) -> None:
        with contextlib.suppress(Exception):  # the breaker is advisory: never fail a request
            await record(pool, ok, now=time.time())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


_outcomes: LoopLocal[_Outcomes] = LoopLocal(_Outcomes)


def note(pool: str, ok: bool) -> None:
    """The outcome of a request before its first token, written in the background: a token
    came (``ok``) or the pool failed it. Successes are coalesced (``SUCCESS_EVERY_S``)."""
    _outcomes.get().note(pool, ok)


def counts_against_pool(code: str, retryable: bool) -> bool:
    """Whether an error event before the first token is the pool's fault (the breaker counts
    it, and the router may retry elsewhere)."""
    return retryable and code in POOL_FAILURES


async def live_workers(pools: Iterable[str], now: float | None = None) -> dict[str, int]:
    """Live workers per pool (heartbeat within ``WORKER_DEAD_AFTER_SECONDS``); read only."""
    names = list(pools)
    pipe = get_async_redis().pipeline(transaction=False)
    for name in names:
        queue_live_count(pipe, name, now)
    return dict(zip(names, [int(n) for n in await pipe.execute()], strict=True))
