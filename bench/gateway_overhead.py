"""Gateway overhead: time to first token through the gateway minus the engine's own.

A zero-delay simulated engine (no step time, no prefill time) serves a pool; an open-loop client
sends streaming requests (max_tokens=1) at fixed rates. For each request:

    client TTFT  = first SSE token event at the client - request sent
    engine TTFT  = first token written by the worker - request dispatched to it (usage record)
    overhead     = client TTFT - engine TTFT

so the overhead is everything the gateway path adds: authentication, tokenizing, admission
(Lua), the WFQ enqueue and dispatch, the worker's claim, the Redis stream relay and SSE.
Target: p50 under 5 ms and p99 under 25 ms at 200 requests/s on this machine.

    python bench/gateway_overhead.py [--rates 50,100,200] [--seconds 10] [--plot out.png]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from _http import (
    System,
    TenantSpec,
    cpu_seconds,
    maybe_plot,
    percentile,
    run_async,
    sse_post,
    stream_body,
)

ZERO_DELAY = {"decode_tokens_per_s": 1e9, "pool_tokens_per_s": None,
              "prefill_tokens_per_s": 1e12}
QUOTA = {"input_tpm": 10**8, "output_tpm": 10**8, "concurrent_requests": 10_000,
         "open_streams": 10_000}


async def run_rate(system: System, rate: float, seconds: float) -> list[Any]:
    url, api_key = system.urls[0], system.keys["bench"]
    body = stream_body(system.model_name, 1)
    start = time.perf_counter()
    tasks = []
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(sse_post(url, api_key, body)))
    return list(await asyncio.gather(*tasks))


def overheads(system: System, results: list[Any]) -> tuple[list[float], list[float], int]:
    records = {r["request_id"]: r for r in system.usage_records()}
    client, over, failed = [], [], 0
    for res in results:
        rec = records.get(res.request_id)
        if res.ttft is None or rec is None or rec.get("first_token_at_ms") is None:
            failed += 1
            continue
        engine = (rec["first_token_at_ms"] - rec["dispatched_at_ms"]) / 1000
        client.append(res.ttft)
        over.append(res.ttft - engine)
    return client, over, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="50,100,200")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--plot")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    with System(backend_settings=ZERO_DELAY, max_sequences=512,
                tenants=[TenantSpec("bench", quota=QUOTA)]) as system:
        run_async(run_rate(system, 20, 1))  # warm up: tokenizer, connections, caches
        for rate in rates:
            from infra.redis_conn import get_redis
            from metering.keys import pending_key

            get_redis().delete(pending_key(system.pool_name))
            gw, wk = system.gateway_pids[0], system.worker_procs[0].pid
            cpu0 = cpu_seconds(gw), cpu_seconds(wk)
            t0 = time.perf_counter()
            results = run_async(run_rate(system, rate, args.seconds))
            wall = time.perf_counter() - t0
            cpu = [(cpu_seconds(p) - c) / len(results) * 1e3 for p, c in zip((gw, wk), cpu0,
                                                                            strict=True)]
            client, over, failed = overheads(system, results)
            rows.append((rate, len(results) / wall, client, over, failed, cpu))
    print(f"\n{'rate':>6} {'achieved':>9} {'client TTFT p50/p99 ms':>24} "
          f"{'overhead p50/p99 ms':>21} {'failed':>7} {'CPU ms/req gw, worker':>22}")
    for rate, achieved, client, over, failed, cpu in rows:
        print(f"{rate:6.0f} {achieved:9.1f} "
              f"{percentile(client, .5) * 1e3:11.2f} / {percentile(client, .99) * 1e3:8.2f} "
              f"{percentile(over, .5) * 1e3:9.2f} / {percentile(over, .99) * 1e3:8.2f} "
              f"{failed:7d} {cpu[0]:11.2f}, {cpu[1]:8.2f}")

    def draw(plt: Any) -> Any:
        fig, ax = plt.subplots()
        ax.plot([r[0] for r in rows], [percentile(r[3], .5) * 1e3 for r in rows], "o-",
                label="overhead p50")
        ax.plot([r[0] for r in rows], [percentile(r[3], .99) * 1e3 for r in rows], "o-",
                label="overhead p99")
        ax.set_xlabel("requests per second")
        ax.set_ylabel("ms")
        ax.legend()
        return fig

    maybe_plot(args.plot, draw)


if __name__ == "__main__":
    main()
