"""Redis commands and CPU per request and per streamed token; the shards and cells a demand needs.

Starts a private ``redis-server`` (so INFO counts only this run), a uvicorn gateway and a pool
worker on the simulated engine (``bench/_http.System``), then runs the same number of streaming
requests twice: short (``--short`` tokens each) and long (``--long``). Around each run it reads
``INFO commandstats`` (calls) and ``INFO cpu`` (``used_cpu_user`` + ``used_cpu_sys``), subtracts
what an idle system costs in the same time (heartbeats), and solves

    total = per_request x requests + per_token x tokens

for both runs (``tenants.redis_capacity.solve_cost``). Then prints the plan for each
``--demand-tpm`` (default: the design's 2 and 20 million output tokens per minute).

    python bench/redis_cost.py                        # small: 2 x 200 requests
    python bench/redis_cost.py --requests 1000 --json cost.json
    python manage.py plan_redis --cost cost.json --demand-tpm 2e6 2e7

Everything shares this machine's cores: Redis CPU is per Redis process, so that is fair, but on
a busy machine the figures include scheduling noise: run it twice and compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.redis_procs import RedisServer  # noqa: E402  (no Django needed)


def start_private_redis() -> RedisServer:
    server = RedisServer("igw-redis-cost-").start()
    os.environ["REDIS_URL"] = server.url  # read by Django's settings below
    return server


REDIS_PROC = start_private_redis()

import redis  # noqa: E402
from _http import System, TenantSpec, run_async, sse_post, stream_body  # noqa: E402

from catalog.redis_capacity import plan_redis, render_redis_text, solve_cost  # noqa: E402

QUOTA = {"input_tpm": 10**9, "output_tpm": 10**9, "concurrent_requests": 100_000,
         "open_streams": 100_000, "ttft_deadline_s": 60, "total_deadline_s": 600}
OWN_COMMANDS = {"info", "config"}  # this script's own probes


@dataclass
class Snapshot:
    at: float
    cpu_s: float
    calls: dict[str, int]  # INFO commandstats, per command (Lua's own calls included)

    @property
    def commands(self) -> int:
        return sum(n for k, n in self.calls.items() if k not in OWN_COMMANDS)


def snapshot(r: redis.Redis) -> Snapshot:
    cpu = r.info("cpu")
    # redis-py names them "get" or "cmdstat_get" depending on its version.
    calls = {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}
    return Snapshot(time.perf_counter(), float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
                    calls)


def top_commands(before: Snapshot, after: Snapshot, per: float) -> str:
    """The commands that grew most between two snapshots, per ``per`` (requests)."""
    grew = sorted(((n - before.calls.get(k, 0), k) for k, n in after.calls.items()),
                  reverse=True)
    return ", ".join(f"{k} {n / per:.1f}" for n, k in grew[:6] if n)


def delta(before: Snapshot, now: Snapshot) -> dict[str, float]:
    return {"seconds": now.at - before.at, "cpu_s": now.cpu_s - before.cpu_s,
            "commands": now.commands - before.commands}


def run_phase(system: System, r: redis.Redis, n: int, tokens: int, concurrency: int,
              idle: dict[str, float] | None) -> dict[str, float]:
    body = stream_body(system.model_name, tokens)
    api_key, url = system.keys["bench"], system.urls[0]

    async def main() -> list[Any]:
        sem = asyncio.Semaphore(concurrency)

        async def one() -> Any:
            async with sem:
                return await sse_post(url, api_key, body)

        return list(await asyncio.gather(*(one() for _ in range(n))))

    before = snapshot(r)
    results = run_async(main())
    # Settlement is written before the last event: nothing of these requests is still pending.
    after = snapshot(r)
    used = delta(before, after)
    ok = [x for x in results if x.status == 200 and not x.error]
    if len(ok) != n:
        errors = sorted({x.error or str(x.status) for x in results if x not in ok})
        raise SystemExit(f"{n - len(ok)} of {n} requests failed: {errors}")
    if idle is not None:  # where the commands go (the warm-up's are not worth a line)
        print(f"  {n} x {tokens} tokens, commands per request: "
              f"{top_commands(before, after, n)}", flush=True)
    idle = idle or {"seconds": 1.0, "cpu_s": 0.0, "commands": 0.0}
    rate = used["seconds"] / idle["seconds"]
    return {"requests": float(n), "tokens": float(sum(x.completion_tokens for x in ok)),
            "cpu_s": max(used["cpu_s"] - idle["cpu_s"] * rate, 0.0),
            "commands": max(used["commands"] - idle["commands"] * rate, 0.0),
            "seconds": used["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--short", type=int, default=4, help="tokens per request, short run")
    parser.add_argument("--long", type=int, default=128, help="tokens per request, long run")
    parser.add_argument("--per-stream", type=float, default=400.0,
                        help="simulated decode rate of each sequence, tokens/s")
    parser.add_argument("--demand-tpm", type=float, nargs="+", default=[2e6, 2e7])
    parser.add_argument("--tokens-per-request", type=float, default=330.0,
                        help="average output tokens per request in the planned demand")
    parser.add_argument("--json", help="write the measured cost and runs here")
    args = parser.parse_args()
    engine = {"decode_tokens_per_s": args.per_stream, "pool_tokens_per_s": None,
              "prefill_tokens_per_s": 1e7}
    try:
        with System(backend_settings=engine, max_sequences=args.concurrency + 16,
                    tenants=[TenantSpec("bench", quota=QUOTA)]) as system:
            r = redis.Redis.from_url(os.environ["REDIS_URL"])
            run_phase(system, r, 10, 4, 10, None)  # warm up: scripts loaded, connections open
            before = snapshot(r)
            time.sleep(3.0)
            idle = delta(before, snapshot(r))
            short = run_phase(system, r, args.requests, args.short, args.concurrency, idle)
            long = run_phase(system, r, args.requests, args.long, args.concurrency, idle)
    finally:
        REDIS_PROC.stop()
    cost = solve_cost(short, long)
    print(f"idle: {idle['cpu_s'] / idle['seconds'] * 1e3:.1f} ms CPU/s, "
          f"{idle['commands'] / idle['seconds']:.0f} commands/s (subtracted)")
    for name, run in (("short", short), ("long", long)):
        print(f"{name} run: {run['requests']:.0f} requests, {run['tokens']:.0f} tokens in "
              f"{run['seconds']:.1f} s: Redis {run['cpu_s']:.3f} CPU s, "
              f"{run['commands']:.0f} commands")
    plans = [plan_redis(cost, output_tpm=d, tokens_per_request=args.tokens_per_request)
             for d in args.demand_tpm]
    print(render_redis_text(cost, plans))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "cost": cost.__dict__, "short": short, "long": long, "idle": idle}, indent=2))


if __name__ == "__main__":
    main()
