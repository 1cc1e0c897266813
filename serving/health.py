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
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings

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
