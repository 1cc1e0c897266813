"""Prometheus metrics at ``/metrics``, kept in Redis so every gateway process reports the same.

A process-local registry would need every process scraped and summed; these numbers instead
live in Redis hashes that any process renders:

- per tenant and model (``metrics:tm:{tenant}:{model}``): requests by status, tokens in and out,
  time to first token and queue wait histograms. The metering writer adds each batch of usage
  records it drains (off the request path, with the engine's own counts and the settlement's
  timings), so they lag settlement by one flush (seconds). A batch re-read after a writer crash
  is counted again: these are operational counters, the bill is the usage table.
- 429s by reason (``metrics:rejected``), counted by the gateway as it refuses.
- active streams per tenant, and per pool the KV-cache use, running and waiting sequences,
  read at scrape time from the admission counters and the workers' heartbeat load.

``RedisCollector`` hands them to prometheus_client, which writes the exposition format.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from infra import quietlog
from infra.keyspace import counter_key, wfq_key
from infra.pool_workers import queue_live_workers, queue_load
from infra.redis_conn import get_redis, key
from metering import fairness, overhead
from metering.keys import pool_names
from metering.models import UsageRecord
from tenants.models import Tenant

BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
PREFIX = "igw"


def tm_key(tenant_id: object, model: str) -> str:
    return key("metrics", "tm", tenant_id, model)


def index_key() -> str:
    return key("metrics", "tm-index")


def rejected_key() -> str:
    return key("metrics", "rejected")


def _bucket(seconds: float) -> str:
    for edge in BUCKETS_S:
        if seconds <= edge:
            return f"{edge:g}"
    return "+Inf"


def add_records(pipe: Any, records: Iterable[UsageRecord]) -> None:
    """Queue the HINCRBYs for a batch of usage records (aggregated per tenant and model)."""
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for rec in records:
        name = tm_key(rec.tenant_id, rec.model_name)
        agg = sums[name]
        agg[f"requests:{rec.status or 'ok'}"] += 1
        agg["tokens_in"] += rec.prompt_tokens
        agg["tokens_out"] += rec.completion_tokens
        for metric, value in (("ttft", rec.ttft_ms), ("queue", rec.queue_wait_ms)):
            if value is None:
                continue
            agg[f"{metric}:{_bucket(value / 1000)}"] += 1
            agg[f"{metric}_sum_ms"] += value
    for name, agg in sums.items():
        pipe.sadd(index_key(), name)
        for field, amount in agg.items():
            if float(amount).is_integer():
                pipe.hincrby(name, field, int(amount))
            else:
                pipe.hincrbyfloat(name, field, amount)


def count_rejection(client: Any, tenant_id: object, model: str, reason: str) -> Any:
    """HINCRBY on the shared 429 counter (awaitable with an asyncio client)."""
    return client.hincrby(rejected_key(), f"{tenant_id}|{model}|{reason}", 1)


# -- exposition --------------------------------------------------------------------------------
#
# prometheus_client formats the text; RedisCollector reads the shared state at scrape time. Every
# read is by name: the series index (for tenant x model), the one rejection hash, the tenants'
# stream counters (the tenant list comes from the database) and the pools set. Nothing scans
# the keyspace, so a scrape costs the same however many other keys Redis holds.


class RedisCollector(Collector):
    """The gateway's metrics, as they stand in Redis (the same from every process)."""

    def __init__(self, client: Any = None) -> None:
        self.client = client

    def collect(self) -> Iterator[Metric]:
        r = self.client or get_redis()
        tenants = dict(Tenant.objects.values_list("pk", "slug"))
        per_tm, rejected, streams = _read_counters(r, list(tenants))
        slug = {str(pk): name for pk, name in tenants.items()}.get
        yield from _tenant_model_metrics(per_tm, slug)
        limited = CounterMetricFamily(f"{PREFIX}_rate_limited", "Requests refused with 429, "
                                      "by reason.", labels=["tenant", "model", "reason"])
        for field, n in sorted(rejected.items()):
            tenant, model, reason = field.split("|", 2)
            limited.add_metric([slug(tenant, tenant), model, reason], n)
        yield limited
        active = GaugeMetricFamily(f"{PREFIX}_active_streams", "Open SSE streams per tenant "
                                   "(all processes).", labels=["tenant"])
        for pk, n in streams.items():
            active.add_metric([tenants[pk]], n)
        yield active
        yield _repeated_log_events(r)
        yield overhead.histogram(r.hgetall(overhead.overhead_key()))
        pools = pool_names(r)
        yield from fairness.metrics(r, pools, slug)
        yield from _pool_metrics(r)


Series = list[tuple[str, str, dict[str, str]]]  # (tenant id, model, hash fields)


def _read_counters(r: Any, tenant_ids: list[int]
                   ) -> tuple[Series, dict[str, int], dict[int, int]]:
    """One pipelined round trip after the index read: every series hash, the 429 counters and
    the tenants' open-stream counters."""
    names = sorted(n.decode() for n in r.smembers(index_key()))
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(name)
    pipe.hgetall(rejected_key())
    if tenant_ids:
        # One GET each, not an MGET: each tenant's counter is on its own slot (ADR 0018).
        for pk in tenant_ids:
            pipe.get(counter_key("streams", pk))
    replies = pipe.execute()
    per_tm = []
    for name, raw in zip(names, replies, strict=False):
        tenant, model = name.split(":tm:", 1)[1].split(":", 1)
        per_tm.append((tenant, model, {k.decode(): v.decode() for k, v in raw.items()}))
    rejected = {k.decode(): int(v) for k, v in replies[len(names)].items()}
    counts = replies[len(names) + 1:]
    streams = {pk: int(v) for pk, v in zip(tenant_ids, counts, strict=True) if v and int(v)}
    return per_tm, rejected, streams


def _tenant_model_metrics(per_tm: Series,
                          slug: Callable[[str, str], str]) -> Iterator[Metric]:
    requests = CounterMetricFamily(f"{PREFIX}_requests", "Settled requests by status.",
                                   labels=["tenant", "model", "status"])
    tokens = CounterMetricFamily(f"{PREFIX}_tokens", "Tokens billed, prompt (in) and "
                                 "completion (out).", labels=["tenant", "model", "direction"])
    for tenant, model, fields in per_tm:
        for field, n in sorted(fields.items()):
            if field.startswith("requests:"):
                requests.add_metric([slug(tenant, tenant), model, field.split(":", 1)[1]],
                                    float(n))
        for direction in ("in", "out"):
            tokens.add_metric([slug(tenant, tenant), model, direction],
                              float(fields.get(f"tokens_{direction}", 0)))
    yield requests
    yield tokens
    for metric, name, text in (("ttft", "time_to_first_token_seconds", "Admission to first token."),
                               ("queue", "queue_wait_seconds", "Admission to dispatch.")):
        family = HistogramMetricFamily(f"{PREFIX}_{name}", text, labels=["tenant", "model"])
        for tenant, model, fields in per_tm:
            running, buckets = 0, []
            for edge in (*(f"{e:g}" for e in BUCKETS_S), "+Inf"):
                running += int(fields.get(f"{metric}:{edge}", 0))
                buckets.append((edge, running))
            family.add_metric([slug(tenant, tenant), model], buckets,
                              float(fields.get(f"{metric}_sum_ms", 0)) / 1000)
        yield family


def _repeated_log_events(r: Any) -> Metric:
    """Warnings that fire per request are logged once a minute and counted here (quietlog)."""
    family = CounterMetricFamily(f"{PREFIX}_repeated_log_events", "Occurrences of warnings "
                                 "that are rate-limited in the log, by event.", labels=["event"])
    for event, n in sorted(r.hgetall(quietlog.counts_key()).items()):
        family.add_metric([event.decode()], float(n))
    return family


def _pool_metrics(r: Any) -> Iterator[Metric]:
    """Per pool, from the queue and the live workers' heartbeat load (two pipelined trips)."""
    pools = pool_names(r)
    pipe = r.pipeline(transaction=False)
    for pool in pools:
        pipe.hlen(wfq_key(pool, "items"))
        queue_live_workers(pipe, pool)
    first = pipe.execute()
    pipe = r.pipeline(transaction=False)
    owners = []
    for i, pool in enumerate(pools):
        for wid in first[2 * i + 1]:
            queue_load(pipe, pool, wid, *LOAD_FIELDS)
            owners.append(pool)
    rows: dict[str, dict[str, float]] = {
        pool: defaultdict(float, queued=float(first[2 * i])) for i, pool in enumerate(pools)}
    for pool, values in zip(owners, pipe.execute() if owners else [], strict=True):
        for field, value in zip(LOAD_FIELDS, values, strict=True):
            rows[pool][field] += float(value or 0)
    for name, help_text, value in (
        ("pool_kv_cache_usage_ratio", "KV-cache tokens in use / capacity (live workers).",
         lambda a: a["kv_tokens_used"] / a["kv_tokens_total"] if a["kv_tokens_total"] else 0.0),
        ("pool_running_sequences", "Sequences running in the engines.", lambda a: a["running"]),
        ("pool_waiting_sequences", "Requests waiting: in the pool's queues and in the engines.",
         lambda a: a["queued"] + a["waiting"]),
    ):
        family = GaugeMetricFamily(f"{PREFIX}_{name}", help_text, labels=["pool"])
        for pool, agg in rows.items():
            v = value(agg)
            family.add_metric([pool], v if math.isfinite(v) else 0.0)
        yield family


LOAD_FIELDS = ("running", "waiting", "kv_tokens_used", "kv_tokens_total")
CONTENT_TYPE = CONTENT_TYPE_LATEST


def render(client: Any = None) -> str:
    """The Prometheus text exposition (the collector runs the ORM: call it from a thread)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RedisCollector(client))
    return generate_latest(registry).decode()
