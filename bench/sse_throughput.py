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

Everything (Redis, worker, gateway, clients) shares this machine's cores, as in MEASUREMENTS.md.

    python bench/sse_throughput.py [--clients 1000] [--per-stream 33.4] [--tokens 330]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from typing import Any

from _http import (
    System,
    TenantSpec,
    maybe_plot,
    rss_mb,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--per-stream", type=float, default=33.4)
    parser.add_argument("--tokens", type=int, default=330)
    parser.add_argument("--ramp", type=float, default=1.0, help="seconds to open all streams")
    parser.add_argument("--gateways", type=int, default=1,
                        help="gateway processes sharing Redis (clients spread round-robin)")
    parser.add_argument("--plot")
    args = parser.parse_args()
    engine = {"decode_tokens_per_s": args.per_stream, "pool_tokens_per_s": None,
              "prefill_tokens_per_s": 1e7}
    with System(backend_settings=engine, max_sequences=args.clients + 64,
                kv_cache_tokens=args.clients * (args.tokens + 64) * 2,
                tenants=[TenantSpec("bench", quota=QUOTA)], gateways=args.gateways) as system:
        asyncio.run(run(system, 10, 5, 0.1))  # warm up
        pid = system.gateway_pids[0]  # memory is reported for the first gateway
        idle_rss = rss_mb(pid)
        sampler = RssSampler(pid)
        sampler.start()
        t0 = time.perf_counter()
        results = asyncio.run(run(system, args.clients, args.tokens, args.ramp))
        wall = time.perf_counter() - t0
        sampler.stop.set()
        records = system.usage_records()
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
    print(f"gateway RSS (one of {args.gateways}) idle {idle_rss:.0f} MB, peak {peak_rss:.0f} MB "
          f"(target < 400 MB)")

    def draw(plt: Any) -> Any:
        fig, ax = plt.subplots()
        ax.plot([s[0] for s in sampler.samples], [s[1] for s in sampler.samples])
        ax.set_xlabel("seconds")
        ax.set_ylabel("gateway RSS (MB)")
        return fig

    maybe_plot(args.plot, draw)


if __name__ == "__main__":
    main()
