"""What OpenTelemetry tracing costs: the same load with tracing off and on, in one run.

A zero-delay simulated engine serves a pool (bench/gateway_overhead.py's setup); an open-loop
client sends streaming requests (max_tokens=1) at ``--rate`` (200/s) for ``--seconds``. Each
round starts a fresh gateway and worker twice, tracing off then on (OTLP/HTTP to an in-process
receiver here, the batch processor flushing every 100 ms, every request sampled), so both
modes share the machine's state; rounds alternate to spread drift. Reported per mode, as the
median over rounds: client TTFT p50/p99, the gateway overhead p50/p99 (client TTFT minus the
engine's), the gateway's own ``x-gateway-overhead-ms``-style figure is not used (it is what is
measured), CPU milliseconds per request in the gateway and in the worker, and spans received.

    python bench/tracing_overhead.py [--rate 200] [--seconds 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from _http import System, TenantSpec, cpu_seconds, percentile, run_async, sse_post, stream_body
from gateway_overhead import QUOTA, ZERO_DELAY, overheads

from infra.redis_conn import get_redis
from metering.keys import pending_key
from tests.otlp_receiver import Receiver

HUNG_AFTER_S = 30.0


async def run_rate(system: System, rate: float, seconds: float) -> tuple[list[Any], int]:
    """Open loop at ``rate``; (answered results, requests hung up on after HUNG_AFTER_S)."""
    url, api_key = system.urls[0], system.keys["bench"]
    body = stream_body(system.model_name, 1)
    start = time.perf_counter()
    tasks = []
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(sse_post(url, api_key, body)))
    done, pending = await asyncio.wait(tasks, timeout=HUNG_AFTER_S)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [t.result() for t in done], len(pending)


def one(env: dict[str, str], rate: float, seconds: float) -> dict[str, float]:
    with System(backend_settings=ZERO_DELAY, max_sequences=512, env=env,
                tenants=[TenantSpec("bench", quota=QUOTA)]) as system:
        run_async(run_rate(system, 20, 1))  # warm up: tokenizer, connections, caches
        get_redis().delete(pending_key(system.pool_name))
        gw, wk = system.gateway_pids[0], system.worker_procs[0].pid
        cpu0 = cpu_seconds(gw), cpu_seconds(wk)
        t0 = time.perf_counter()
        results, hung = run_async(run_rate(system, rate, seconds))
        wall = time.perf_counter() - t0
        cpu = [(cpu_seconds(p) - c) / len(results) * 1e3
               for p, c in zip((gw, wk), cpu0, strict=True)]
        client, over, failed = overheads(system, results)
    return {"achieved": len(results) / wall, "ttft_p50": percentile(client, .5) * 1e3,
            "ttft_p99": percentile(client, .99) * 1e3, "over_p50": percentile(over, .5) * 1e3,
            "over_p99": percentile(over, .99) * 1e3, "cpu_gw": cpu[0], "cpu_worker": cpu[1],
            "failed": failed, "hung": hung}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    receiver = Receiver()
    traced_env = {**receiver.env(), "OTEL_TRACES_SAMPLER": "always_on"}
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    spans = 0
    try:
        for _ in range(args.rounds):
            runs["off"].append(one({}, args.rate, args.seconds))
            before = len(receiver.spans)
            runs["on"].append(one(traced_env, args.rate, args.seconds))
            spans += len(receiver.spans) - before
    finally:
        receiver.stop()
    fields = ("achieved", "ttft_p50", "ttft_p99", "over_p50", "over_p99", "cpu_gw",
              "cpu_worker", "failed", "hung")
    med: dict[str, dict[str, float]] = {
        mode: {f: statistics.median(r[f] for r in rs) for f in fields} for mode, rs in runs.items()}
    for mode, rs in runs.items():
        print(f"{mode}: " + "; ".join(", ".join(f"{f} {r[f]:.2f}" for f in fields) for r in rs))
    print(f"\ntracing at {args.rate:.0f} requests/s, {args.seconds:.0f} s x {args.rounds} rounds "
          "(medians over rounds)")
    print(f"{'mode':>5} {'achieved':>9} {'TTFT p50/p99 ms':>17} {'overhead p50/p99 ms':>21} "
          f"{'CPU ms/req gw, worker':>22} {'failed':>7} {'hung':>5}")
    for mode, m in med.items():
        print(f"{mode:>5} {m['achieved']:9.1f} {m['ttft_p50']:7.2f} / {m['ttft_p99']:7.2f} "
              f"{m['over_p50']:9.2f} / {m['over_p99']:8.2f} {m['cpu_gw']:11.2f}, "
              f"{m['cpu_worker']:8.2f} {m['failed']:7.0f} {m['hung']:5.0f}")
    d: dict[str, Any] = {f: med["on"][f] - med["off"][f] for f in fields}
    print(f"delta: overhead p50 {d['over_p50']:+.2f} ms, p99 {d['over_p99']:+.2f} ms; CPU "
          f"{d['cpu_gw']:+.2f} ms/req gateway, {d['cpu_worker']:+.2f} ms/req worker; "
          f"{spans / max(1, args.rounds):.0f} spans received per traced round")


if __name__ == "__main__":
    main()
