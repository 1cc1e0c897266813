"""Cancel latency: from a client hanging up mid-stream to the engine dropping the sequence.

Clients open streaming requests (``ignore_eos``, long ``max_tokens``), read a few token events,
then close the connection. The gateway sees ``http.disconnect`` (even while it waits for the
next token), cancels; the worker aborts the sequence in the engine and settles it with the
engine's own counts. The settlement time in the usage record (Redis TIME, written in the
worker's step right after the abort) minus the moment the client closed is the latency.
Target: p99 under 100 ms.

    python bench/cancel_latency.py [--requests 200] [--concurrency 20] [--plot out.png]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from _http import System, TenantSpec, maybe_plot, sse_post, stream_body, summary_ms

QUOTA = {"input_tpm": 10**9, "output_tpm": 10**9, "concurrent_requests": 100_000,
         "open_streams": 100_000, "max_output_tokens": 4000}


async def one(system: System, rng: random.Random) -> tuple[str, float]:
    res = await sse_post(system.urls[0], system.keys["bench"],
                         stream_body(system.model_name, 4000),
                         close_after_events=rng.randint(2, 30))
    return res.request_id, time.time()


async def run(system: System, n: int, concurrency: int) -> list[tuple[str, float]]:
    rng = random.Random(7)
    gate = asyncio.Semaphore(concurrency)

    async def limited() -> tuple[str, float]:
        async with gate:
            return await one(system, rng)

    return list(await asyncio.gather(*(limited() for _ in range(n))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--per-stream", type=float, default=50.0,
                        help="engine tokens/s per sequence")
    parser.add_argument("--plot")
    args = parser.parse_args()
    engine = {"decode_tokens_per_s": args.per_stream, "pool_tokens_per_s": None}
    with System(backend_settings=engine, max_sequences=256,
                tenants=[TenantSpec("bench", quota=QUOTA)]) as system:
        closed = asyncio.run(run(system, args.requests, args.concurrency))
        deadline = time.time() + 15
        records: dict[str, Any] = {}
        while time.time() < deadline and len(records) < len(closed):
            records = {r["request_id"]: r for r in system.usage_records()}
            time.sleep(0.2)
    latencies = [records[rid]["settled_at_ms"] / 1000 - at for rid, at in closed
                 if rid in records]
    statuses = sorted({records[rid]["status"] for rid, _ in closed if rid in records})
    print(f"\n{len(latencies)} of {len(closed)} cancelled requests settled "
          f"(statuses {statuses}); engine {args.per_stream} tokens/s per stream, "
          f"{args.concurrency} streams at a time")
    print(f"disconnect -> engine abort   {summary_ms(latencies)}   (p99 target < 100 ms)")

    def draw(plt: Any) -> Any:
        fig, ax = plt.subplots()
        ax.hist([x * 1000 for x in latencies], bins=40)
        ax.set_xlabel("disconnect to abort (ms)")
        return fig

    maybe_plot(args.plot, draw)


if __name__ == "__main__":
    main()
