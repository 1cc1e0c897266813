"""Soak: 200 tenants with realistic mixes, >= 1,000 concurrent streams, for ``--minutes``.

Gateways and pool workers run as subprocesses with the simulated engine (``_http.System``);
the load generator holds one asyncio "user" loop per simulated user:

- steady tenants: a few users each, one request after another (20-160 output tokens);
- bursty tenants: idle, then a burst of many requests at once, then idle again;
- one noisy tenant: far more users than its concurrency quota (it gets 429s and backs off);
- long-context tenants: ~3,000-token prompts, short answers.

A metering writer thread drains usage records into PostgreSQL meanwhile. At the end, after the
users stop and everything settles, it checks and reports:

- no leaked slots: every tenant's and key's concurrency/open-stream counter is 0; the pool's
  queue, the deadlines zset, every worker's in-flight set and reserved KV are empty;
- memory per process over time (RSS of each gateway and worker, sampled every ``--sample``
  seconds): growth from the end of the warm-up to the end must stay under ``--rss-bound`` MB;
- no lost usage records: every request a client saw complete has exactly one record, with the
  completion tokens the client was told, and the records of the run add up to exactly the
  tokens delivered (sum of client-side usage + records of requests that ended early);
- per-tenant TTFT p95 (distribution over tenants, per class; the worst tenants).

Exit status 1 when a check fails.

    python bench/soak.py [--minutes 10] [--tenants 200] [--streams 1000] [--plot soak.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from _http import (
    Result,
    System,
    TenantSpec,
    maybe_plot,
    percentile,
    rss_mb,
    run_async,
    sse_post,
)

from infra.redis_conn import get_redis, pool_key
from metering.keys import pending_key, pool_names, processing_key
from serving.admission import counter_key

BIG = 10**9
LONG_PROMPT = "Summarise the following report. " + "The quarterly figures were steady. " * 500


@dataclass
class Mix:
    steady: list[str] = field(default_factory=list)
    bursty: list[str] = field(default_factory=list)
    noisy: list[str] = field(default_factory=list)
    long: list[str] = field(default_factory=list)

    def kind(self, slug: str) -> str:
        for name in ("steady", "bursty", "noisy", "long"):
            if slug in getattr(self, name):
                return name
        return "?"


def quota(kind: str, streams: int) -> dict[str, Any]:
    # The noisy tenant runs streams/10 users against a quota of half that: it meets 429s.
    conc = max(5, streams // 20) if kind == "noisy" else 200
    return {"input_tpm": BIG, "input_burst": BIG, "output_tpm": BIG, "output_burst": BIG,
            "concurrent_requests": conc, "open_streams": conc, "max_output_tokens": 4000,
            "ttft_deadline_s": 60.0, "total_deadline_s": 300.0}


def plan(n_tenants: int, streams: int) -> tuple[Mix, list[TenantSpec]]:
    mix = Mix()
    n_bursty, n_long = max(1, n_tenants // 5), max(1, n_tenants // 20)
    for i in range(n_tenants):
        slug = f"t{i:03d}"
        if i == 0:
            mix.noisy.append(slug)
        elif i <= n_bursty:
            mix.bursty.append(slug)
        elif i <= n_bursty + n_long:
            mix.long.append(slug)
        else:
            mix.steady.append(slug)
    specs = [TenantSpec(s, quota=quota(mix.kind(s), streams)) for s in
             mix.noisy + mix.bursty + mix.long + mix.steady]
    return mix, specs


@dataclass(eq=False)
class Done:
    tenant: str
    result: Result
    at: float  # seconds since the start of the run


class Load:
    """Users per tenant, so that about ``streams`` requests are open at any time."""

    def __init__(self, system: System, mix: Mix, streams: int, seed: int = 7) -> None:
        self.system, self.mix, self.rng = system, mix, random.Random(seed)
        self.stop_at = 0.0
        self.t0 = 0.0
        self.done: list[Done] = []
        self.open = 0
        self.peak_open = 0
        self.open_samples: list[tuple[float, int]] = []
        n_users = {"noisy": max(20, streams // 10), "long": 3}
        steady_users = max(1, (streams - n_users["noisy"] - 3 * len(mix.long)
                               - 6 * len(mix.bursty)) // max(1, len(mix.steady)))
        self.users = ([(s, "noisy") for s in mix.noisy for _ in range(n_users["noisy"])]
                      + [(s, "long") for s in mix.long for _ in range(3)]
                      + [(s, "steady") for s in mix.steady for _ in range(steady_users)])
        self.bursty = mix.bursty

    def body(self, kind: str, rng: random.Random) -> dict[str, Any]:
        content = LONG_PROMPT if kind == "long" else "Tell me a story."
        max_tokens = rng.randint(10, 40) if kind == "long" else rng.randint(20, 160)
        return {"model": self.system.model_name, "messages": [{"role": "user",
                                                               "content": content}],
                "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}

    async def request(self, slug: str, kind: str, rng: random.Random) -> Result:
        url = self.system.urls[rng.randrange(len(self.system.urls))]
        self.open += 1
        self.peak_open = max(self.peak_open, self.open)
        try:
            result = await sse_post(url, self.system.keys[slug], self.body(kind, rng))
        finally:
            self.open -= 1
        self.done.append(Done(slug, result, time.perf_counter() - self.t0))
        return result

    async def user(self, slug: str, kind: str, i: int) -> None:
        rng = random.Random(hash((slug, i)))
        await asyncio.sleep(rng.random() * 10)  # ramp up over 10 s
        while time.perf_counter() < self.stop_at:
            result = await self.request(slug, kind, rng)
            if result.status == 429:
                await asyncio.sleep(0.5 + rng.random())  # the noisy tenant backs off
            else:
                await asyncio.sleep(rng.random() * 0.5)  # think time

    async def burster(self, slug: str) -> None:
        rng = random.Random(hash(slug))
        await asyncio.sleep(rng.random() * 20)
        while time.perf_counter() < self.stop_at:
            n = rng.randint(10, 30)
            await asyncio.gather(*(self.request(slug, "bursty", rng) for _ in range(n)))
            await asyncio.sleep(rng.uniform(5, 20))

    async def sampler(self, every: float) -> None:
        while time.perf_counter() < self.stop_at:
            self.open_samples.append((time.perf_counter() - self.t0, self.open))
            await asyncio.sleep(every)

    async def run(self, seconds: float) -> None:
        self.t0 = time.perf_counter()
        self.stop_at = self.t0 + seconds
        await asyncio.gather(self.sampler(1.0),
                             *(self.user(s, k, i) for i, (s, k) in enumerate(self.users)),
                             *(self.burster(s) for s in self.bursty))


class Watch(threading.Thread):
    """RSS of every gateway and worker over time; drains usage records into PostgreSQL."""

    def __init__(self, system: System, every: float) -> None:
        super().__init__(daemon=True)
        self.system, self.every, self.stop = system, every, threading.Event()
        self.rss: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.flushed = 0
        self.flush_errors = 0

    def procs(self) -> dict[str, int]:
        out = {f"gateway{i}": pid for i, pid in enumerate(self.system.gateway_pids)}
        out.update({f"worker{i}": p.pid for i, p in enumerate(self.system.worker_procs)})
        return out

    def run(self) -> None:
        from django.db import connection

        from metering.writer import flush

        t0 = time.perf_counter()
        while not self.stop.wait(self.every):
            for name, pid in self.procs().items():
                self.rss[name].append((time.perf_counter() - t0, rss_mb(pid)))
            try:
                result = flush()
                self.flushed += result.inserted if result else 0
            except Exception:
                self.flush_errors += 1
        connection.close()


def leftovers(system: System, tenants: list[Any]) -> dict[str, int]:
    r = get_redis()
    out: dict[str, int] = {}
    for t in tenants:
        for kind in ("conc", "streams"):
            for scope, ident in [("tenant", t.pk), *(("key", k.pk) for k in t.api_keys.all())]:
                value = int(r.get(counter_key(kind, t.pk, scope, ident)) or 0)
                if value:
                    out[f"{kind}:{scope}:{ident}"] = value
    out["queued"] = r.hlen(pool_key("wfq", system.pool_name, "items"))
    out["deadlines"] = r.zcard(pool_key("deadlines", system.pool_name))
    for i in range(system.n_workers):
        wid = f"{system.pool_name}-w{i}"
        out[f"{wid}:inflight"] = r.scard(pool_key("worker", system.pool_name, wid, "inflight"))
        load = r.hgetall(pool_key("worker", system.pool_name, wid, "load"))
        out[f"{wid}:kv_reserved"] = int(load.get(b"kv_tokens_reserved", 0) or 0)
        out[f"{wid}:in_flight"] = int(load.get(b"in_flight", 0) or 0)
    return {k: v for k, v in out.items() if v}


def records_of_run(tenant_ids: set[int]) -> dict[str, dict[str, Any]]:
    """Every usage record of the run: in PostgreSQL, or still buffered in Redis."""
    from metering.models import UsageRecord

    out: dict[str, dict[str, Any]] = {}
    for rec in UsageRecord.objects.filter(tenant_id__in=tenant_ids).values(
            "request_id", "completion_tokens", "status"):
        out[rec["request_id"]] = rec
    r = get_redis()
    raws = []
    for pool in pool_names(r):
        raws += r.lrange(pending_key(pool), 0, -1) + r.lrange(processing_key(pool), 0, -1)
    for raw in raws:
        rec = json.loads(raw)
        if rec["tenant_id"] in tenant_ids:
            out.setdefault(rec["request_id"], rec)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--tenants", type=int, default=200)
    parser.add_argument("--streams", type=int, default=1000, help="concurrent streams to hold")
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--per-stream", type=float, default=8.0, help="decode tokens/s")
    parser.add_argument("--sample", type=float, default=5.0, help="RSS sample interval, s")
    parser.add_argument("--warmup", type=float, default=30.0, help="s excluded from RSS growth")
    parser.add_argument("--rss-bound", type=float, default=100.0,
                        help="MB a process may grow after the warm-up")
    parser.add_argument("--plot")
    args = parser.parse_args()
    seconds = args.minutes * 60
    mix, specs = plan(args.tenants, args.streams)
    seqs = args.streams // args.workers + 128
    engine = {"decode_tokens_per_s": args.per_stream, "pool_tokens_per_s": None,
              "prefill_tokens_per_s": 200_000.0}
    env = {"WORKER_HEARTBEAT_SECONDS": "1", "WORKER_DEAD_AFTER_SECONDS": "10",
           "SSE_KEEPALIVE_SECONDS": "15"}
    with System(backend_settings=engine, max_sequences=seqs, kv_cache_tokens=seqs * 4000,
                tenants=specs, workers=args.workers, gateways=args.gateways, env=env) as system:
        from tenants.models import Tenant

        tenants = list(Tenant.objects.filter(slug__startswith="bench-t"))
        tenant_ids = {t.pk for t in tenants}
        watch = Watch(system, args.sample)
        watch.start()
        load = Load(system, mix, args.streams)
        t_start = time.perf_counter()
        run_async(load.run(seconds))
        elapsed = time.perf_counter() - t_start

        def settled() -> bool:
            return not leftovers(system, tenants)

        deadline = time.monotonic() + 30
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.5)
        left = leftovers(system, tenants)
        watch.stop.set()
        watch.join(30)
        from metering.writer import flush

        flush()
        records = records_of_run(tenant_ids)

    done = load.done
    ok = [d for d in done if d.result.status == 200 and not d.result.error]
    rejected = [d for d in done if d.result.status == 429]
    failed = [d for d in done if not (d.result.status == 200 and not d.result.error)
              and d.result.status != 429]
    admitted = {d.result.request_id for d in done if d.result.status == 200}
    problems: list[str] = []
    missing = [d for d in ok if d.result.request_id not in records]
    mismatched = [d for d in ok if d.result.request_id in records and
                  records[d.result.request_id]["completion_tokens"] != d.result.completion_tokens]
    extra = set(records) - admitted
    delivered = sum(d.result.completion_tokens for d in ok)
    billed_ok = sum(records[d.result.request_id]["completion_tokens"] for d in ok
                    if d.result.request_id in records)
    if missing:
        problems.append(f"{len(missing)} completed requests without a usage record")
    if mismatched:
        problems.append(f"{len(mismatched)} records disagree with what the client was told")
    if extra:
        problems.append(f"{len(extra)} records of requests no client saw admitted")
    if left:
        problems.append(f"leaked slots/state: {left}")

    print(f"\nsoak: {args.minutes:g} min, {args.tenants} tenants ({len(mix.steady)} steady, "
          f"{len(mix.bursty)} bursty, {len(mix.noisy)} noisy, {len(mix.long)} long-context), "
          f"{args.gateways} gateways, {args.workers} workers, {args.per_stream:g} tok/s/stream")
    opened = [n for t, n in load.open_samples if t > 15]
    print(f"concurrent streams   median {statistics.median(opened) if opened else 0:.0f}, "
          f"peak {load.peak_open}")
    kinds = sorted({str(d.result.error or d.result.status) for d in failed})[:6]
    print(f"requests             {len(done):,}: ok {len(ok):,}, 429 {len(rejected):,}, "
          f"failed {len(failed):,} {kinds}")
    print(f"tokens delivered     {delivered:,} ({delivered / elapsed:,.0f}/s); billed for them "
          f"{billed_ok:,}; records {len(records):,} for {len(admitted):,} admitted requests")
    print(f"usage writer         {watch.flushed:,} records written during the run, "
          f"{watch.flush_errors} failed flushes")
    print(f"leaked slots         {left or 'none'}")
    print("memory (RSS MB)      process: after warm-up -> end (max); growth")
    for name, samples in sorted(watch.rss.items()):
        warm = [v for t, v in samples if t >= args.warmup] or [v for _, v in samples]
        growth = warm[-1] - warm[0] if warm else 0.0
        print(f"  {name:<10} {warm[0]:7.1f} -> {warm[-1]:7.1f} ({max(warm):7.1f}); "
              f"{growth:+.1f} (bound {args.rss_bound:g})")
        if growth > args.rss_bound:
            problems.append(f"{name} grew {growth:.0f} MB")
    per_tenant: dict[str, list[float]] = defaultdict(list)
    for d in ok:
        if d.result.ttft is not None:
            per_tenant[d.tenant].append(d.result.ttft)
    p95 = {s: percentile(v, 0.95) for s, v in per_tenant.items() if v}
    print("TTFT p95 per tenant  class: tenants, min / median / max of their p95 (ms)")
    for kind in ("steady", "bursty", "noisy", "long"):
        vals = [p95[s] * 1000 for s in getattr(mix, kind) if s in p95]
        if vals:
            print(f"  {kind:<8} {len(vals):4d}  {min(vals):8.0f} / {statistics.median(vals):8.0f}"
                  f" / {max(vals):8.0f}")
    worst = sorted(p95.items(), key=lambda kv: -kv[1])[:5]
    print("  worst: " + ", ".join(f"{s} ({mix.kind(s)}) {v * 1000:.0f}" for s, v in worst))
    print("RESULT: " + ("OK" if not problems else "FAILED: " + "; ".join(problems)))

    def draw(plt: Any) -> Any:
        fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
        window = 10.0
        buckets: dict[int, list[Done]] = defaultdict(list)
        for d in ok:
            buckets[int(d.at // window)].append(d)
        xs = sorted(buckets)
        ttfts = [[x.result.ttft * 1000 for x in buckets[b] if x.result.ttft] for b in xs]
        ax1.plot([b * window for b in xs], [percentile(v, 0.5) for v in ttfts], label="p50")
        ax1.plot([b * window for b in xs], [percentile(v, 0.95) for v in ttfts], label="p95")
        ax1.set_ylabel("TTFT (ms)")
        ax1.legend()
        ax2.plot([b * window for b in xs],
                 [sum(x.result.completion_tokens for x in buckets[b]) / window for b in xs])
        ax2.set_ylabel("tokens/s (completed)")
        ax3.plot([t for t, _ in load.open_samples], [n for _, n in load.open_samples])
        ax3.set_ylabel("open streams")
        ax3.set_xlabel("seconds")
        return fig

    maybe_plot(args.plot, draw)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
