"""Fairness as a service-level objective: what each tenant of a pool received against its share.

Fed by the usage writer from settled requests (off the request path), read at scrape time:

- **Service** in VTC units (Sheng et al., OSDI 2024; ``WFQ_INPUT_PRICE`` x prompt tokens +
  ``WFQ_OUTPUT_PRICE`` x output tokens), attributed in time as bench/http_fairness.py measures
  it: the prompt when its first token came, the output spread evenly from first token to end.
  Kept per pool in one-second buckets, ``fair:{p.POOL}:svc:{second}`` (hash tenant -> units,
  expiring after twice the window), so a window is a pipelined read of its buckets.
- **Latency samples**: each tenant's recent (time, queue wait, TTFT) in a capped list,
  ``fair:{p.POOL}:lat:{tenant}`` (the newest ``SAMPLES``).

Per pool and tenant over the last ``FAIRNESS_WINDOW_SECONDS``:

- ``service_share``: the tenant's service / the pool's; ``weighted_share``: its weight (the
  WFQ's ``wfq:{p.POOL}:weight``) / the weights of the tenants active in the window (served in it,
  or backlogged now); ``share_ratio`` = service_share / weighted_share (1 = exactly its share;
  the alert fires for a backlogged tenant below 0.8 for 5 minutes).
- ``max_service_diff`` (per pool): VTC's fairness measure, the largest difference of service /
  weight between two tenants backlogged now, over the window.
- ``queue_wait_p95`` and ``ttft_p95`` from the samples in the window; ``uncontended_ttft_p95``
  from the tenant's recent samples that did not wait in the queue (queue wait under
  ``UNCONTENDED_WAIT_MS``: the pool had room when they came), and ``ttft_slowdown`` = their
  ratio, how much slower the tenant's first tokens are when the pool is contended.

A record counted twice (a writer that crashed between commit and release) adds its service
twice: these are operational figures; the bill is the usage table.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from prometheus_client.core import GaugeMetricFamily, Metric

from infra.keyspace import wfq_key
from infra.redis_conn import pool_key
from metering.models import UsageRecord

SAMPLES = 1000
UNCONTENDED_WAIT_MS = 10


def service_key(pool: str, second: int) -> str:
    return pool_key("fair", pool, "svc", second)


def samples_key(pool: str, tenant: object) -> str:
    return pool_key("fair", pool, "lat", tenant)


def weights_key(pool: str) -> str:
    return wfq_key(pool, "weight")


def heads_key(pool: str) -> str:
    return wfq_key(pool, "heads")


def spread(prompt: int, output: int, first_ms: float, end_ms: float) -> Iterator[tuple[int, float]]:
    """(second, VTC units) of one request: the prompt at its first token, the output evenly
    from first token to end (as bench/http_fairness.service_at counts it)."""
    price_in, price_out = settings.WFQ_INPUT_PRICE, settings.WFQ_OUTPUT_PRICE
    first, end = first_ms / 1000, max(first_ms, end_ms) / 1000
    yield int(first), price_in * prompt
    units = price_out * output
    if not units:
        return
    if end - first < 1e-3:
        yield int(first), units
        return
    t = first
    while t < end:
        step_end = min(end, math.floor(t) + 1)
        yield int(t), units * (step_end - t) / (end - first)
        t = step_end


def add_records(pipe: Any, pairs: Iterable[tuple[UsageRecord, Mapping[str, Any]]]) -> None:
    """Queue the writes for a batch of settled requests (the usage writer's pipeline)."""
    window = settings.FAIRNESS_WINDOW_SECONDS
    service: dict[tuple[str, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for rec, data in pairs:
        first, end = data.get("first_token_at_ms"), data.get("settled_at_ms")
        if not rec.pool_name or first is None or end is None:
            continue  # never started: no service, no TTFT
        tenant = str(rec.tenant_id)
        for second, units in spread(rec.prompt_tokens, rec.completion_tokens, float(first),
                                    float(end)):
            service[(rec.pool_name, second)][tenant] += units
        sample = f"{float(end) / 1000:.3f},{rec.queue_wait_ms or 0},{rec.ttft_ms or 0}"
        pipe.lpush(samples_key(rec.pool_name, tenant), sample)
        pipe.ltrim(samples_key(rec.pool_name, tenant), 0, SAMPLES - 1)
        pipe.expire(samples_key(rec.pool_name, tenant), 86_400)
    for (pool, second), per_tenant in service.items():
        name = service_key(pool, second)
        for tenant, units in per_tenant.items():
            pipe.hincrbyfloat(name, tenant, units)
        pipe.expire(name, 2 * window + 60)


@dataclass
class TenantFigures:
    service: float = 0.0
    weight: float = 1.0
    backlogged: bool = False
    service_share: float = 0.0
    weighted_share: float = 0.0
    queue_wait_p95_s: float | None = None
    ttft_p95_s: float | None = None
    uncontended_ttft_p95_s: float | None = None

    @property
    def share_ratio(self) -> float | None:
        return self.service_share / self.weighted_share if self.weighted_share else None

    @property
    def ttft_slowdown(self) -> float | None:
        if not self.ttft_p95_s or not self.uncontended_ttft_p95_s:
            return None
        return self.ttft_p95_s / self.uncontended_ttft_p95_s


@dataclass
class PoolFigures:
    pool: str
    tenants: dict[str, TenantFigures] = field(default_factory=dict)
    max_service_diff: float = 0.0
    total_service: float = 0.0


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def figures(r: Any, pool: str, since: float | None = None,
            until: float | None = None) -> PoolFigures:
    """One pool's figures over [since, until) (default: the last FAIRNESS_WINDOW_SECONDS)."""
    until = time.time() if until is None else until
    since = until - settings.FAIRNESS_WINDOW_SECONDS if since is None else since
    seconds = range(int(since), math.ceil(until))
    pipe = r.pipeline(transaction=False)
    for second in seconds:
        pipe.hgetall(service_key(pool, second))
    pipe.hgetall(weights_key(pool))
    pipe.zrange(heads_key(pool), 0, -1)
    replies = pipe.execute()
    service: dict[str, float] = defaultdict(float)
    for raw in replies[:len(seconds)]:
        for tenant, units in raw.items():
            service[tenant.decode()] += float(units)
    weights = {k.decode(): float(v) for k, v in replies[len(seconds)].items()}
    backlogged = {t.decode() for t in replies[len(seconds) + 1]}
    out = PoolFigures(pool, total_service=sum(service.values()))
    active = set(service) | backlogged
    wsum = sum(weights.get(t, 1.0) for t in active) or 1.0
    for tenant in sorted(active):
        f = TenantFigures(service=service.get(tenant, 0.0), weight=weights.get(tenant, 1.0),
                          backlogged=tenant in backlogged)
        f.service_share = f.service / out.total_service if out.total_service else 0.0
        f.weighted_share = f.weight / wsum
        out.tenants[tenant] = f
    norm = [f.service / f.weight for f in out.tenants.values() if f.backlogged and f.weight]
    out.max_service_diff = max(norm) - min(norm) if len(norm) > 1 else 0.0
    _latencies(r, pool, out, since, until)
    return out


def _latencies(r: Any, pool: str, out: PoolFigures, since: float, until: float) -> None:
    pipe = r.pipeline(transaction=False)
    for tenant in out.tenants:
        pipe.lrange(samples_key(pool, tenant), 0, -1)
    for f, raw in zip(out.tenants.values(), pipe.execute(), strict=True):
        waits, ttfts, calm = [], [], []
        for item in raw:
            at, wait, ttft = (float(x) for x in item.decode().split(","))
            if wait < UNCONTENDED_WAIT_MS:
                calm.append(ttft / 1000)
            if since <= at < until:
                waits.append(wait / 1000)
                ttfts.append(ttft / 1000)
        f.queue_wait_p95_s, f.ttft_p95_s = p95(waits), p95(ttfts)
        f.uncontended_ttft_p95_s = p95(calm)


# -- exposition ----------------------------------------------------------------------------------

GAUGES = (
    ("service_units", "VTC service received over the window (input x price + output x price).",
     lambda f: f.service),
    ("service_share", "The tenant's fraction of the pool's service over the window.",
     lambda f: f.service_share),
    ("weighted_share", "The tenant's weight over the weights of the pool's active tenants.",
     lambda f: f.weighted_share),
    ("share_ratio", "service_share / weighted_share (1 = its share; alert below 0.8).",
     lambda f: f.share_ratio),
    ("backlogged", "1 if the tenant has requests queued in the pool now.",
     lambda f: float(f.backlogged)),
    ("queue_wait_p95_seconds", "Queue wait p95 over the window.", lambda f: f.queue_wait_p95_s),
    ("ttft_p95_seconds", "Time to first token p95 over the window.", lambda f: f.ttft_p95_s),
    ("uncontended_ttft_p95_seconds", "TTFT p95 of the tenant's recent requests that did not "
     "wait in the queue.", lambda f: f.uncontended_ttft_p95_s),
    ("ttft_slowdown", "ttft_p95 / uncontended_ttft_p95.", lambda f: f.ttft_slowdown),
)


def metrics(r: Any, pools: Iterable[str], slug: Any) -> Iterator[Metric]:
    """The ``igw_fair_*`` gauges of every pool (tenant labels are slugs)."""
    per_pool = [figures(r, pool) for pool in pools]
    for name, text, value in GAUGES:
        family = GaugeMetricFamily(f"igw_fair_{name}", text, labels=["pool", "tenant"])
        for pf in per_pool:
            for tenant, f in pf.tenants.items():
                v = value(f)
                if v is not None:
                    family.add_metric([pf.pool, slug(tenant, tenant)], float(v))
        yield family
    diff = GaugeMetricFamily("igw_fair_max_service_diff", "Largest difference of service / "
                             "weight between two backlogged tenants over the window (VTC).",
                             labels=["pool"])
    for pf in per_pool:
        diff.add_metric([pf.pool], pf.max_service_diff)
    yield diff
