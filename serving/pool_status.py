"""A pool's live state, read from Redis for the Pool admin (``workers.admin``): workers, queue
depth, running sequences, KV cache use.

Workers publish this themselves (``workers.host``: heartbeat scores in ``workers:{pool}``, a
load hash in ``worker:{id}:load`` that expires when the worker stops beating); the queue depth
is the pool's WFQ backlog. Nothing here writes, and a Redis outage gives ``None``, not an error
page.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from infra.pool_workers import load_key, workers_key
from infra.redis_conn import get_redis
from serving.wfq import Wfq


@dataclass
class WorkerState:
    worker_id: str
    seconds_since_beat: float
    alive: bool
    running: int = 0
    waiting: int = 0
    max_running: int = 0
    kv_tokens_used: int = 0
    kv_tokens_total: int = 0
    draining: bool = False


@dataclass
class PoolState:
    workers: list[WorkerState] = field(default_factory=list)
    queued: int = 0
    queued_by_tenant: dict[str, int] = field(default_factory=dict)

    @property
    def live_workers(self) -> list[WorkerState]:
        return [w for w in self.workers if w.alive]

    @property
    def running(self) -> int:
        return sum(w.running for w in self.live_workers)

    @property
    def max_running(self) -> int:
        return sum(w.max_running for w in self.live_workers)

    @property
    def kv_used(self) -> int:
        return sum(w.kv_tokens_used for w in self.live_workers)

    @property
    def kv_total(self) -> int:
        return sum(w.kv_tokens_total for w in self.live_workers)

    @property
    def kv_percent(self) -> float:
        return round(100 * self.kv_used / self.kv_total, 1) if self.kv_total else 0.0


def _int(raw: dict[Any, Any], name: str) -> int:
    try:
        return int(float(raw.get(name.encode(), b"0")))
    except ValueError:
        return 0


def pool_state(pool_name: str) -> PoolState | None:
    try:
        client = get_redis()
        now = time.time()
        dead_after = settings.WORKER_DEAD_AFTER_SECONDS
        state = PoolState()
        members: list[tuple[bytes, float]] = client.zrange(  # type: ignore[assignment]
            workers_key(pool_name), 0, -1, withscores=True)
        for member, score in members:
            wid = member.decode()
            load: dict[Any, Any] = client.hgetall(load_key(pool_name, wid))
            age = max(now - score, 0.0)
            state.workers.append(WorkerState(
                wid, round(age, 1), age <= dead_after and bool(load),
                running=_int(load, "running"), waiting=_int(load, "waiting"),
                max_running=_int(load, "max_running"),
                kv_tokens_used=_int(load, "kv_tokens_used"),
                kv_tokens_total=_int(load, "kv_tokens_total"),
                draining=bool(_int(load, "draining")),
            ))
        state.queued_by_tenant = Wfq(client).backlog(pool_name)
        state.queued = sum(state.queued_by_tenant.values())
        return state
    except Exception:  # the admin page renders without live numbers
        return None
