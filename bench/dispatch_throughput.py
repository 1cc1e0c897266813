"""Dispatcher throughput: dispatch decisions per second with many backlogged tenants.

One client process (one core) fills a pool with TENANTS x PER_TENANT requests, then drains it
through the real Lua scripts, one dispatch per round trip and in batches (dispatch_many), under
both policies. Redis runs as its own process; the time it spends inside each script call is read
from INFO commandstats (server-wide EVALSHA average), so the table also says how far one Redis
core is from saturating. Target: >= 5,000 decisions/s with 200 tenants.

    REDIS_URL=redis://127.0.0.1:6379/4 .venv/bin/python bench/dispatch_throughput.py \
        [--plot out.png]

It only touches the keys of its own pool (``--pool``) and one worker's in-flight set.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gateway.settings")

import django

django.setup()

import redis  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402

from infra.redis_conn import redis_url  # noqa: E402
from serving.keys import inflight_key  # noqa: E402
from serving.wfq import AsyncWfq, EngineShares, Prices, Wfq  # noqa: E402

WORKER = "bench-worker"
PRICES = Prices(1.0, 2.0)


@dataclass
class Sample:
    ops: int
    seconds: float
    script_usec: float  # Redis time per EVALSHA call during the run (server-wide average), or nan

    @property
    def rate(self) -> float:
        return self.ops / self.seconds


def evalsha_stats(client: redis.Redis) -> tuple[int, int]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


def measure(client: redis.Redis, fn: Callable[[], int], *, scripts: bool = True) -> Sample:
    (calls0, usec0), t0 = evalsha_stats(client), time.perf_counter()
    ops = fn()
    seconds = time.perf_counter() - t0
    calls, usec = evalsha_stats(client)
    per_call = (usec - usec0) / (calls - calls0) if scripts and calls > calls0 else math.nan
    return Sample(ops, seconds, per_call)


def fill(wfq: Wfq, pool: str, tenants: int, per_tenant: int, seed: int) -> int:
    """Enqueue round-robin over tenants, so every tenant is backlogged to the end."""
    rng = random.Random(seed)
    for j in range(per_tenant):
        for t in range(tenants):
            wfq.enqueue(pool, f"tenant-{t}", f"r{t}-{j}", weight=1 + t % 3,
                        prompt_tokens=rng.randint(50, 4000),
                        max_output_tokens=rng.randint(16, 1024), kv_tokens=rng.randint(1, 4096))
    return tenants * per_tenant


FAIR_SLOTS = 64  # the slot-fair mode's worker: 63 sequences running, one slot free


def drain_fair(wfq: Wfq, pool: str, tenants: int, *, engine: bool = False) -> int:
    """One decision per call with slot fairness on, as EngineHost makes it: the worker passes
    its running sequences per tenant (one each for the first 63 tenants, so those are at their
    share and the script must skip them: the costliest case, docs/adr/0006).

    ``engine``: the worker also passes its engine's state (rule E, docs/adr/0017): each running
    tenant has a prompt waiting for prefill and KV held, so a pick that reaches one computes
    its engine shares (U exact once per call)."""
    running = {f"tenant-{t}": 1 for t in range(min(tenants, FAIR_SLOTS - 1))}
    shares = EngineShares(20_000.0, 381_000.0, dict.fromkeys(running, 4_000),
                          dict.fromkeys(running, 4_000)) if engine else None
    free = FAIR_SLOTS - sum(running.values())
    done = 0
    while wfq.dispatch(pool, free_slots=free, free_kv_tokens=10**9, worker_id=WORKER,
                       running=running, engine=shares):
        done += 1
    return done


def drain(wfq: Wfq, pool: str, batch: int) -> int:
    done = 0
    if batch == 1:  # the plain single-request call a worker makes when one slot frees
        while wfq.dispatch(pool, free_slots=1, free_kv_tokens=10**9, worker_id=WORKER):
            done += 1
        return done
    while items := wfq.dispatch_many(pool, n=batch, free_slots=batch,
                                     free_kv_tokens=10**9, worker_id=WORKER):
        done += len(items)
    return done


def drain_async(pool: str, policy: str) -> int:
    async def run() -> int:
        client = aioredis.Redis.from_url(redis_url())
        awfq, done = AsyncWfq(client, policy=policy, prices=PRICES), 0
        while await awfq.dispatch(pool, free_slots=1, free_kv_tokens=10**9, worker_id=WORKER):
            done += 1
        await client.aclose()
        return done

    return asyncio.run(run())


def ping_floor(client: redis.Redis, n: int) -> int:
    """Bare round trips from this client: the ceiling for one-call-per-decision dispatch."""
    for _ in range(n):
        client.ping()
    return n


def one_run(client: redis.Redis, args, policy: str, mode: str, seed: int) -> dict[str, Sample]:
    wfq = Wfq(client, policy=policy, prices=PRICES)
    wfq.reset(args.pool)
    client.delete(inflight_key(args.pool, WORKER))
    filled = measure(client, lambda: fill(wfq, args.pool, args.tenants, args.per_tenant, seed))
    if mode == "async dispatch":
        drained = measure(client, lambda: drain_async(args.pool, policy))
    elif mode in ("dispatch, slot-fair", "dispatch, engine-fair"):
        # It stops once only the capped tenants have work left; the rest is drained untimed.
        engine = mode != "dispatch, slot-fair"
        drained = measure(client, lambda: drain_fair(wfq, args.pool, args.tenants,
                                                     engine=engine))
        assert drained.ops + drain(wfq, args.pool, 1) == filled.ops, "lost or doubled"
    else:
        batch = 1 if mode == "dispatch" else args.batch
        drained = measure(client, lambda: drain(wfq, args.pool, batch))
        assert drained.ops == filled.ops, "the drain must dispatch every request exactly once"
    wfq.reset(args.pool)
    client.delete(inflight_key(args.pool, WORKER))
    return {"enqueue": filled, mode: drained}


def run_all(args) -> list[tuple[str, str, list[Sample]]]:
    client = redis.Redis.from_url(redis_url())
    modes = ["dispatch", f"dispatch_many({args.batch})", "async dispatch", "dispatch, slot-fair",
             "dispatch, engine-fair"]
    rows: dict[tuple[str, str], list[Sample]] = {}
    for run in range(args.runs):  # runs outermost: machine noise spreads over every row
        ping = measure(client, lambda: ping_floor(client, args.tenants * args.per_tenant),
                       scripts=False)
        rows.setdefault(("PING (baseline)", "-"), []).append(ping)
        for policy in ("wfq", "fifo"):
            for mode in modes:
                for name, sample in one_run(client, args, policy, mode, seed=run).items():
                    rows.setdefault((name, policy), []).append(sample)
    return [("PING (baseline)", "-", rows["PING (baseline)", "-"])] + [
        (name, policy, rows[name, policy]) for policy in ("wfq", "fifo")
        for name in ["enqueue", *modes]]


def print_table(rows, tenants: int) -> None:
    print(f"{'mode':<23}{'policy':<8}{'tenants':>8}{'ops/s (median)':>16}{'min':>9}{'max':>9}"
          f"{'us/op':>8}{'redis us/call':>15}")
    for name, policy, samples in rows:
        rates = [s.rate for s in samples]
        median_rate = statistics.median(rates)
        script = statistics.median(s.script_usec for s in samples)
        script_text = "-" if math.isnan(script) else f"{script:.1f}"
        # Nothing dispatched (fewer tenants than the slot-fair cases hold at their share): no
        # time per decision.
        per_op = f"{1e6 / median_rate:.1f}" if median_rate else "-"
        print(f"{name:<23}{policy:<8}{tenants:>8}{median_rate:>16,.0f}{min(rates):>9,.0f}"
              f"{max(rates):>9,.0f}{per_op:>8}{script_text:>15}")


def plot(rows, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipping the plot (pip install '.[bench]')")
        return
    labels = [f"{name} ({policy})" for name, policy, _ in rows]
    medians = [statistics.median(s.rate for s in samples) for _, _, samples in rows]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh(labels[::-1], medians[::-1], color="#b0420c")
    ax.axvline(5000, color="#2b6a24", linestyle="--", label="target 5,000/s")
    ax.set_xlabel("operations per second (median)")
    ax.set_title("WFQ dispatcher, one client process, backlogged tenants")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=200)
    parser.add_argument("--per-tenant", type=int, default=50)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pool", default="bench-dispatch")
    parser.add_argument("--plot", metavar="FILE")
    args = parser.parse_args()
    print(f"{args.tenants} tenants x {args.per_tenant} requests, median of {args.runs} runs, "
          f"Redis at {redis_url()}\n")
    rows = run_all(args)
    print_table(rows, args.tenants)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
