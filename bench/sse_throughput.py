"""Streaming throughput and memory: many concurrent SSE clients through one gateway process.

The design's peak is 33,333 output tokens/s, about 1,042 concurrent streams at 32 tokens/s
each. This opens ``--clients`` streams at once against one uvicorn gateway and one pool worker
whose simulated engine decodes every running sequence at ``--per-stream`` tokens/s (no pool
cap), each asking for ``--tokens`` tokens, and reports:

- tokens/s delivered to the clients (counted from each stream's final usage chunk) over the
  time all streams were open together, and per-stream rate;
- time to first token p50/p95/max (target: p95 under 2 s);
- the gateway process's resident memory before and at its peak (target: under 400 MB with
  1,000 open streams).

Everything (Redis, worker, gateways, clients) shares this machine's cores, as in MEASUREMENTS.md.
Two gateway processes by default, as a deployment runs one per core (uvicorn is one thread): one
process relaying 33k events/s has no CPU left for a burst of admissions.

    python bench/sse_throughput.py --clients 1050 --duration 30   # throughput, steady state
    python bench/sse_throughput.py                                # 1,000 streams opened in 1 s
    python bench/sse_throughput.py --gateways 1                   # one process holds all 1,000

In the closed loop each client spends a TTFT between streams not streaming, so 1,050 clients keep
about 1,020 streams open at any moment (the design: 1,042 streams at 32 tokens/s = 33,333).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import threading
import time
from typing import Any

from _http import (
    System,
    TenantSpec,
    cpu_seconds,
    maybe_plot,
    redis_cpu_seconds,
    rss_mb,
    run_async,
    sse_post,
    stream_body,
    summary_ms,
)

QUOTA = {"input_tpm": 10**9, "output_tpm": 10**9, "concurrent_requests": 100_000,
         "open_streams": 100_000, "ttft_deadline_s": 60, "total_deadline_s": 600}


class RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.samples, self.stop = pid, [], threading.Event()

    def run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop.wait(0.25):
            self.samples.append((time.perf_counter() - t0, rss_mb(self.pid)))


async def run(system: System, clients: int, tokens: int, ramp_s: float) -> list[Any]:
    body = stream_body(system.model_name, tokens)
    urls, api_key = system.urls, system.keys["bench"]

    async def one(i: int) -> Any:
        await asyncio.sleep(ramp_s * i / clients)
        return await sse_post(urls[i % len(urls)], api_key, body)

    return list(await asyncio.gather(*(one(i) for i in range(clients))))


async def steady(system: System, clients: int, tokens: int, ramp_s: float,
                 duration: float) -> tuple[list[Any], list[tuple[float, int]], float]:
    """Closed loop: ``clients`` slots, each starting a new stream as soon as its last one ends,
    for ``duration`` seconds. Returns the results, (time, events so far) samples, and t0."""
    body = stream_body(system.model_name, tokens)
    urls, api_key = system.urls, system.keys["bench"]
    tally = [0]
    t0 = time.perf_counter()
    stop_at = t0 + duration

    async def slot(i: int) -> list[Any]:
        await asyncio.sleep(ramp_s * i / clients)
        # The first stream of each slot is shorter by a different amount, so the slots do not
        # all end and reconnect together: arrivals settle at clients / stream length per second.
        first = stream_body(system.model_name, max(1, tokens * (i + 1) // clients))
        done = [await sse_post(urls[i % len(urls)], api_key, first, tally=tally)]
        while time.perf_counter() < stop_at:
            done.append(await sse_post(urls[i % len(urls)], api_key, body, tally=tally))
        return done

    samples: list[tuple[float, int]] = []

    async def sample() -> None:
        while True:
            samples.append((time.perf_counter() - t0, tally[0]))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    slots = await asyncio.gather(*(slot(i) for i in range(clients)))
    sampler.cancel()
    return [r for done in slots for r in done], samples, t0


def report_steady(args: argparse.Namespace, results: list[Any],
                  samples: list[tuple[float, int]], t0: float) -> None:
    """Throughput and TTFT once every slot is streaming (after the ramp and one stream length)."""
    settle = args.ramp + 0.5 * args.tokens / args.per_stream  # arrivals spread out by then
    window = [(t, n) for t, n in samples if settle <= t <= args.duration]
    rate = ((window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0])
            if len(window) > 1 else float("nan"))
    later = [r for r in results if r.started - t0 >= settle]
    ttfts = [r.ttft for r in later if r.ttft is not None]
    failed = [r for r in results if r.status != 200 or r.error]
    print(f"\nsteady state: {args.clients} clients in a closed loop for {args.duration:.0f} s, "
          f"{args.tokens} tokens each, engine {args.per_stream} tokens/s per stream")
    kinds = sorted({str(r.error or r.status) for r in failed})
    print(f"{'streams done':<22}{len(results) - len(failed)} (failed {len(failed)}"
          f"{': ' + ', '.join(kinds) if kinds else ''})")
    print(f"{'events/s (~tokens/s)':<22}{rate:,.0f}  from {settle:.0f} s to the end "
          f"(target 33,333)")
    print(f"{'TTFT after the ramp':<22}{summary_ms(ttfts)}  (p95 target < 2000 ms)")


def ttft_split(results: list[Any], records: list[dict[str, Any]]) -> str:
    """Client TTFT minus the serving core's part (admitted -> first token written, Redis clock):
    what the gateway adds before admission (auth, tokenizing) and while relaying the token."""
    by_id = {r["request_id"]: r for r in records}
    gateway = []
    for res in results:
        rec = by_id.get(res.request_id)
        if res.ttft is not None and rec and rec.get("first_token_at_ms"):
            core = (rec["first_token_at_ms"] - rec["admitted_at_ms"]) / 1e3
            gateway.append(res.ttft - core)
    return summary_ms(gateway)


def cpu_use(system: System) -> dict[str, float]:
    """CPU seconds used so far by each part (all share the same cores)."""
    times = os.times()
    return {
        "gateways": sum(cpu_seconds(p) for p in system.gateway_pids),
        "worker": sum(cpu_seconds(p.pid) for p in system.worker_procs),
        "redis": redis_cpu_seconds(),
        "clients": times.user + times.system,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-stream", type=float, default=33.4)
    parser.add_argument("--tokens", type=int, default=330)
    parser.add_argument("--ramp", type=float, default=1.0, help="seconds to open all streams")
    parser.add_argument("--gateways", type=int, default=2,
                        help="gateway processes sharing Redis (clients spread round-robin)")
    parser.add_argument("--duration", type=float, default=0.0,
                        help="steady state: keep --clients streams open for this many seconds "
                             "(each slot starts a new stream when its last ends); 0 = one burst")
    parser.add_argument("--plot")
    args = parser.parse_args()
    engine = {"decode_tokens_per_s": args.per_stream, "pool_tokens_per_s": None,
              "prefill_tokens_per_s": 1e7}
    with System(backend_settings=engine, max_sequences=args.clients + 64,
                kv_cache_tokens=args.clients * (args.tokens + 64) * 2,
                tenants=[TenantSpec("bench", quota=QUOTA)], gateways=args.gateways) as system:
        run_async(run(system, 10, 5, 0.1))  # warm up
        pid = system.gateway_pids[0]  # memory is reported for the first gateway
        idle_rss = rss_mb(pid)
        sampler = RssSampler(pid)
        sampler.start()
        cpu0 = cpu_use(system)
        t0 = time.perf_counter()
        if args.duration:
            results, samples, t_start = run_async(
                steady(system, args.clients, args.tokens, args.ramp, args.duration))
        else:
            results = run_async(run(system, args.clients, args.tokens, args.ramp))
        wall = time.perf_counter() - t0
        cpu = {k: (v - cpu0[k]) / wall for k, v in cpu_use(system).items()}
        sampler.stop.set()
        records = system.usage_records()
    if args.duration:
        report_steady(args, results, samples, t_start)
        print(f"{'  gateway part':<22}{ttft_split(results, records)}")
        peak = max((s[1] for s in sampler.samples), default=float("nan"))
        print(f"{'gateway RSS':<22}idle {idle_rss:.0f} MB, peak {peak:.0f} MB "
              f"(one of {args.gateways}; target < 400 MB)")
        print(f"{'CPU (cores busy)':<22}" + "  ".join(f"{k} {v:.2f}" for k, v in cpu.items())
              + f"  total {sum(cpu.values()):.2f} of {os.cpu_count()}")

        def draw_rate(plt: Any) -> Any:
            fig, ax = plt.subplots()
            pts = list(itertools.pairwise(samples))
            ax.plot([b[0] for _, b in pts], [(b[1] - a[1]) / (b[0] - a[0]) for a, b in pts])
            ax.axhline(33_333, linestyle="--", color="grey")
            ax.set_xlabel("seconds")
            ax.set_ylabel("SSE token events/s delivered")
            return fig

        maybe_plot(args.plot, draw_rate)
        return
    ok = [r for r in results if r.status == 200 and not r.error]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tokens = sum(r.completion_tokens for r in ok)
    # The window when every stream was open: last first token .. first end.
    together = min(r.ended for r in ok) - max(r.first_token or 0 for r in ok) if ok else 0
    rates = [r.completion_tokens / (r.ended - r.first_token) for r in ok
             if r.first_token and r.ended > r.first_token]
    peak_rss = max((s[1] for s in sampler.samples), default=float("nan"))
    print(f"\nclients {args.clients}, {args.tokens} tokens each, engine {args.per_stream} "
          f"tokens/s per stream")
    print(f"completed            {len(ok)} / {len(results)}  (errors: "
          f"{sorted({r.error or r.status for r in results if r not in ok})})")
    print(f"tokens delivered     {tokens:,} in {wall:.1f} s  = {tokens / wall:,.0f} tokens/s "
          f"overall")
    print(f"aggregate rate       {statistics.median(rates) * len(ok) if rates else 0:,.0f} "
          f"tokens/s (median per-stream rate {statistics.median(rates) if rates else 0:.1f} "
          f"x {len(ok)} streams; all open together for {max(together, 0):.1f} s)")
    print(f"TTFT                 {summary_ms(ttfts)}  (p95 target < 2000 ms)")
    waits = [r["queue_wait_ms"] / 1e3 for r in records if r.get("queue_wait_ms") is not None]
    firsts = [(r["first_token_at_ms"] - r["dispatched_at_ms"]) / 1e3 for r in records
              if r.get("first_token_at_ms") and r.get("dispatched_at_ms")]
    print(f"  admitted->dispatch {summary_ms(waits)}")
    print(f"  dispatch->1st tok  {summary_ms(firsts)}")
    print(f"  gateway's part     {ttft_split(ok, records)}")
    engine = [r["completion_tokens"] / ((r["settled_at_ms"] - r["first_token_at_ms"]) / 1e3)
              for r in records if r.get("first_token_at_ms") and r.get("settled_at_ms")
              and r["settled_at_ms"] > r["first_token_at_ms"] and r.get("completion_tokens")]
    if engine:
        print(f"engine's own rate    median {statistics.median(engine):.1f} tokens/s per stream "
              f"(first token to settle, Redis clock): what the relay could deliver at most")
    print(f"gateway RSS (one of {args.gateways}) idle {idle_rss:.0f} MB, peak {peak_rss:.0f} MB "
          f"(target < 400 MB)")
    print("CPU (cores busy)     " + "  ".join(f"{k} {v:.2f}" for k, v in cpu.items())
          + f"  total {sum(cpu.values()):.2f} of {os.cpu_count()}")

    def draw(plt: Any) -> Any:
        fig, ax = plt.subplots()
        ax.plot([s[0] for s in sampler.samples], [s[1] for s in sampler.samples])
        ax.set_xlabel("seconds")
        ax.set_ylabel("gateway RSS (MB)")
        return fig

    maybe_plot(args.plot, draw)


if __name__ == "__main__":
    main()
