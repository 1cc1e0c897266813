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
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from django.conf import settings

from infra.redis_conn import get_redis, key
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


# -- rendering --------------------------------------------------------------------------------


def _labels(**labels: object) -> str:
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _histogram(out: list[str], name: str, fields: Mapping[str, str], metric: str,
               labels: dict[str, object]) -> None:
    running = 0
    for edge in (*(f"{e:g}" for e in BUCKETS_S), "+Inf"):
        running += int(fields.get(f"{metric}:{edge}", 0))
        out.append(f"{name}_bucket{_labels(**labels, le=edge)} {running}")
    out.append(f"{name}_sum{_labels(**labels)} {float(fields.get(f'{metric}_sum_ms', 0)) / 1000}")
    out.append(f"{name}_count{_labels(**labels)} {running}")


def _tenant_names(ids: set[str]) -> dict[str, str]:
    numeric = [int(i) for i in ids if i.isdigit()]
    return {str(pk): slug for pk, slug in Tenant.objects.filter(pk__in=numeric)
            .values_list("pk", "slug")}


def render() -> str:
    r = get_redis()
    names = sorted(n.decode() for n in r.smembers(index_key()))
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(name)
    hashes = pipe.execute()
    rejected = {k.decode(): int(v) for k, v in r.hgetall(rejected_key()).items()}
    streams = {k.decode().rsplit(":", 1)[1]: int(r.get(k) or 0)
               for k in r.scan_iter(key("streams", "tenant", "*"), count=1000)}
    per_tm = []
    for name, raw in zip(names, hashes, strict=True):
        tenant, model = name.split(":tm:", 1)[1].split(":", 1)
        per_tm.append((tenant, model, {k.decode(): v.decode() for k, v in raw.items()}))
    slugs = _tenant_names({t for t, _, _ in per_tm} | {k.split("|")[0] for k in rejected}
                          | set(streams))
    out: list[str] = []
    _tenant_model_metrics(out, per_tm, slugs)
    out.append(f"# HELP {PREFIX}_rate_limited_total Requests refused with 429, by reason.")
    out.append(f"# TYPE {PREFIX}_rate_limited_total counter")
    for field, n in sorted(rejected.items()):
        tenant, model, reason = field.split("|", 2)
        labels = _labels(tenant=slugs.get(tenant, tenant), model=model, reason=reason)
        out.append(f"{PREFIX}_rate_limited_total{labels} {n}")
    out.append(f"# HELP {PREFIX}_active_streams Open SSE streams per tenant (all processes).")
    out.append(f"# TYPE {PREFIX}_active_streams gauge")
    for tenant, n in sorted(streams.items()):
        out.append(f"{PREFIX}_active_streams{_labels(tenant=slugs.get(tenant, tenant))} {n}")
    _pool_metrics(out, r)
    return "\n".join(out) + "\n"


def _tenant_model_metrics(out: list[str], per_tm: list[tuple[str, str, dict[str, str]]],
                          slugs: Mapping[str, str]) -> None:
    out.append(f"# HELP {PREFIX}_requests_total Settled requests by status.")
    out.append(f"# TYPE {PREFIX}_requests_total counter")
    for tenant, model, fields in per_tm:
        for field, n in sorted(fields.items()):
            if field.startswith("requests:"):
                labels = _labels(tenant=slugs.get(tenant, tenant), model=model,
                                 status=field.split(":", 1)[1])
                out.append(f"{PREFIX}_requests_total{labels} {n}")
    out.append(f"# HELP {PREFIX}_tokens_total Tokens billed, prompt (in) and completion (out).")
    out.append(f"# TYPE {PREFIX}_tokens_total counter")
    for tenant, model, fields in per_tm:
        for direction in ("in", "out"):
            labels = _labels(tenant=slugs.get(tenant, tenant), model=model, direction=direction)
            out.append(f"{PREFIX}_tokens_total{labels} {fields.get(f'tokens_{direction}', 0)}")
    for metric, name, text in (("ttft", "time_to_first_token_seconds", "Admission to first token."),
                               ("queue", "queue_wait_seconds", "Admission to dispatch.")):
        out.append(f"# HELP {PREFIX}_{name} {text}")
        out.append(f"# TYPE {PREFIX}_{name} histogram")
        for tenant, model, fields in per_tm:
            _histogram(out, f"{PREFIX}_{name}", fields, metric,
                       {"tenant": slugs.get(tenant, tenant), "model": model})


def _pool_metrics(out: list[str], r: Any) -> None:
    cutoff = time.time() - settings.WORKER_DEAD_AFTER_SECONDS
    rows: dict[str, dict[str, float]] = {}
    for raw in sorted(r.smembers(key("pools"))):
        pool = raw.decode()
        agg = rows.setdefault(pool, defaultdict(float))
        agg["queued"] = int(r.hlen(key("wfq", pool, "items")))
        for wid in r.zrangebyscore(key("workers", pool), cutoff, "+inf"):
            load = r.hgetall(key("worker", wid.decode(), "load"))
            for field in ("running", "waiting", "kv_tokens_used", "kv_tokens_total"):
                agg[field] += float(load.get(field.encode(), 0) or 0)
    for name, help_text, value in (
        ("pool_kv_cache_usage_ratio", "KV-cache tokens in use / capacity (live workers).",
         lambda a: a["kv_tokens_used"] / a["kv_tokens_total"] if a["kv_tokens_total"] else 0.0),
        ("pool_running_sequences", "Sequences running in the engines.", lambda a: a["running"]),
        ("pool_waiting_sequences", "Requests waiting: in the pool's queues and in the engines.",
         lambda a: a["queued"] + a["waiting"]),
    ):
        out.append(f"# HELP {PREFIX}_{name} {help_text}")
        out.append(f"# TYPE {PREFIX}_{name} gauge")
        for pool, agg in rows.items():
            v = value(agg)
            out.append(f"{PREFIX}_{name}{_labels(pool=pool)} {v:g}" if math.isfinite(v)
                       else f"{PREFIX}_{name}{_labels(pool=pool)} 0")
