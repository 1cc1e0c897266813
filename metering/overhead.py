"""The gateway's own overhead per request, as a Prometheus histogram per pool.

Overhead is the wall time a request spent in the gateway process minus the time it waited for
the worker (queue wait, prefill, decode: the time spent awaiting the submission's events) and
minus the client's upload. It covers authentication, parsing, tokenizing, admission and
enqueue (their Redis round trips included), relaying and answer assembly. The consumer sends it
as ``x-gateway-overhead-ms`` (measured when the headers go out: at the end of a whole answer,
at the first token of a stream) and observes the full figure here when the request ends.

Observations are buffered per event loop and added to one Redis hash (``metrics:overhead``,
fields ``{pool}|{bucket}``, ``{pool}|sum_ms``, ``{pool}|count``) in one pipelined HINCRBY
batch a second, so the per-request cost is a dict update, not a round trip; every process's
observations land in the same hash, and ``/metrics`` reads them from any process. A process
that dies loses at most its last second of observations (operational figures, not a bill).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import HistogramMetricFamily, Metric

from infra.loop_local import LoopLocal
from infra.redis_conn import get_async_redis, key

log = logging.getLogger(__name__)

BUCKETS_MS = (0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0)
FLUSH_EVERY_S = 1.0


def overhead_key() -> str:
    return key("metrics", "overhead")


def bucket_of(ms: float) -> str:
    for edge in BUCKETS_MS:
        if ms <= edge:
            return f"{edge:g}"
    return "+Inf"


class Buffer:
    """One event loop's unflushed observations and its flusher task."""

    def __init__(self) -> None:
        self.fields: dict[str, float] = defaultdict(float)
        self._task: asyncio.Task[None] | None = None

    def observe(self, pool: str, ms: float) -> None:
        pool = pool or "unrouted"
        self.fields[f"{pool}|{bucket_of(ms)}"] += 1
        self.fields[f"{pool}|sum_ms"] += ms
        self.fields[f"{pool}|count"] += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._flush_soon(),
                                                                name="overhead-flush")

    async def _flush_soon(self) -> None:
        await asyncio.sleep(FLUSH_EVERY_S)
        try:
            await self.flush()
        except Exception:  # Redis away: keep them for the next try
            log.warning("overhead metrics flush failed", exc_info=True)

    async def flush(self) -> None:
        fields, self.fields = self.fields, defaultdict(float)
        if not fields:
            return
        pipe = get_async_redis().pipeline(transaction=False)
        for name, amount in fields.items():
            if amount.is_integer():
                pipe.hincrby(overhead_key(), name, int(amount))
            else:
                pipe.hincrbyfloat(overhead_key(), name, amount)
        try:
            await pipe.execute()
        except BaseException:
            for name, amount in fields.items():
                self.fields[name] += amount
            raise


_buffers: LoopLocal[Buffer] = LoopLocal(Buffer)


def observe(pool: str, ms: float) -> None:
    """Count one request's overhead (call on the event loop; flushed within a second)."""
    _buffers.get().observe(pool, ms)


def histogram(raw: Mapping[Any, Any]) -> Metric:
    """``igw_gateway_overhead_seconds{pool}`` from the ``metrics:overhead`` hash."""
    fields = {(k.decode() if isinstance(k, bytes) else str(k)): float(v) for k, v in raw.items()}
    family = HistogramMetricFamily("igw_gateway_overhead_seconds", "Time spent in the gateway "
                                   "itself per request (excluding queue wait, engine time and "
                                   "the client's upload).", labels=["pool"])
    for pool in sorted({name.split("|", 1)[0] for name in fields}):
        family.add_metric([pool], list(_cumulative(fields, pool)),
                          fields.get(f"{pool}|sum_ms", 0.0) / 1000)
    return family


def _cumulative(fields: dict[str, float], pool: str) -> Iterator[tuple[str, float]]:
    running = 0.0
    for edge in BUCKETS_MS:
        running += fields.get(f"{pool}|{edge:g}", 0.0)
        yield f"{edge / 1000:g}", running
    yield "+Inf", running + fields.get(f"{pool}|+Inf", 0.0)
