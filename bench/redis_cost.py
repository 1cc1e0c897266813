"""Redis commands and CPU per request and per streamed token; the shards and cells a demand needs.

Starts a private ``redis-server`` (so INFO counts only this run), a uvicorn gateway and a pool
worker on the simulated engine (``bench/_http.System``), then runs the same number of streaming
requests twice: short (``--short`` tokens each) and long (``--long``). Around each run it reads
``INFO commandstats`` (calls) and ``INFO cpu`` (``used_cpu_user`` + ``used_cpu_sys``), subtracts
what an idle system costs in the same time (heartbeats), and solves

    total = per_request x requests + per_token x tokens

for both runs (``catalog.redis_capacity.solve_cost``). Then prints the plan for each
``--demand-tpm`` (default: the design's 2 and 20 million output tokens per minute).

    python bench/redis_cost.py                        # small: 2 x 200 requests
    python bench/redis_cost.py --requests 1000 --json cost.json
    python bench/redis_cost.py --baseline /tmp/base   # A/B: that checkout first, then this one
    python manage.py plan_redis --cost cost.json --demand-tpm 2e6 2e7

Round trips: a second pair of runs (``--trips-requests`` each) watches ``MONITOR`` and counts
the commands clients send (a script's own calls excluded), solved per request and per token as
above. A pipelined command is counted although it shares its round trip, so the figure is an
upper bound on round trips (the worker's settle rides in its last relay step's pipeline).
Round trips themselves are counted by Redis: ``INFO stats`` ``total_reads_processed`` (one read
event per request or pipeline a client sends, idle subtracted), solved per request and per
token in the same two runs; a large pipeline can take two reads, so it is close, not exact.
``--baseline DIR`` runs this same file inside another checkout (its code, its processes) before
this one, in one invocation, and prints both with the ratio.

Everything shares this machine's cores: Redis CPU is per Redis process, so that is fair, but on
a busy machine the figures include scheduling noise: run it twice and compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
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
    reads: int = 0  # INFO stats total_reads_processed: client read events, ~ round trips

    @property
    def commands(self) -> int:
        return sum(n for k, n in self.calls.items() if k not in OWN_COMMANDS)


def snapshot(r: redis.Redis) -> Snapshot:
    cpu = r.info("cpu")
    # redis-py names them "get" or "cmdstat_get" depending on its version.
    calls = {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}
    reads = int(r.info("stats").get("total_reads_processed", 0))
    return Snapshot(time.perf_counter(), float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
                    calls, reads)


def top_commands(before: Snapshot, after: Snapshot, per: float) -> str:
    """The commands that grew most between two snapshots, per ``per`` (requests)."""
    grew = sorted(((n - before.calls.get(k, 0), k) for k, n in after.calls.items()),
                  reverse=True)
    return ", ".join(f"{k} {n / per:.1f}" for n, k in grew[:6] if n)


def delta(before: Snapshot, now: Snapshot) -> dict[str, float]:
    # A snapshot's own three INFO commands are three read events.
    return {"seconds": now.at - before.at, "cpu_s": now.cpu_s - before.cpu_s,
            "commands": now.commands - before.commands,
            "reads": float(now.reads - before.reads - 3)}


class Monitor:
    """Counts the commands clients send, per command name, from ``MONITOR`` in a thread.

    Commands a Lua script runs are reported by MONITOR as the "lua" client: left out, so what
    is counted is what crosses the network (a pipelined command still counts once).
    """

    def __init__(self, url: str) -> None:
        self._mon = redis.Redis.from_url(url).monitor().__enter__()
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                cmd = self._mon.next_command()
                if cmd.get("client_type") == "lua":
                    continue
                name = str(cmd.get("command", "")).split(" ", 1)[0].lower()
                with self._lock:
                    self.calls[name] += 1
        except Exception:  # the connection closes at the end
            return

    def total(self) -> int:
        with self._lock:
            return sum(n for k, n in self.calls.items() if k not in OWN_COMMANDS | {"monitor"})

    def by_name(self) -> Counter[str]:
        with self._lock:
            return Counter(self.calls)


def _requests(system: System, n: int, tokens: int, concurrency: int) -> list[Any]:
    body = stream_body(system.model_name, tokens)
    api_key, url = system.keys["bench"], system.urls[0]

    async def main() -> list[Any]:
        sem = asyncio.Semaphore(concurrency)

        async def one() -> Any:
            async with sem:
                return await sse_post(url, api_key, body)

        return list(await asyncio.gather(*(one() for _ in range(n))))

    return run_async(main())


def trips_phase(system: System, mon: Monitor, n: int, tokens: int, concurrency: int,
                idle_per_s: float) -> dict[str, float]:
    """Client commands of ``n`` requests, less what an idle system sends in the same time."""
    before, at, names = mon.total(), time.perf_counter(), mon.by_name()
    results = _requests(system, n, tokens, concurrency)
    time.sleep(0.3)  # MONITOR lags the commands a little
    used, took = mon.total() - before, time.perf_counter() - at
    grew = mon.by_name()
    grew.subtract(names)
    top = ", ".join(f"{k} {c / n:.2f}" for k, c in grew.most_common(16) if c > 0)
    print(f"  {n} x {tokens} tokens, client commands per request: {top}", flush=True)
    return {"requests": float(n), "tokens": float(sum(x.completion_tokens for x in results)),
            "commands": max(used - idle_per_s * took, 0.0), "cpu_s": 0.0}


def run_phase(system: System, r: redis.Redis, n: int, tokens: int, concurrency: int,
              idle: dict[str, float] | None) -> dict[str, float]:
    before = snapshot(r)
    results = _requests(system, n, tokens, concurrency)
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
    idle = idle or {"seconds": 1.0, "cpu_s": 0.0, "commands": 0.0, "reads": 0.0}
    rate = used["seconds"] / idle["seconds"]
    return {"requests": float(n), "tokens": float(sum(x.completion_tokens for x in ok)),
            "cpu_s": max(used["cpu_s"] - idle["cpu_s"] * rate, 0.0),
            "commands": max(used["commands"] - idle["commands"] * rate, 0.0),
            "reads": max(used["reads"] - idle["reads"] * rate, 0.0),
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
    parser.add_argument("--trips-requests", type=int, default=100,
                        help="requests per run of the MONITOR pair (0: skip it)")
    parser.add_argument("--baseline", help="another checkout to measure first (A/B)")
    args = parser.parse_args()
    if args.baseline:
        ab(args)
        return
    measure(args)


def measure(args: argparse.Namespace) -> dict[str, Any]:
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
            trips = measure_trips(system, args)
    finally:
        REDIS_PROC.stop()
    cost = solve_cost(short, long)
    # Round trips: Redis's read events (a pipeline is one, however many commands it carries).
    trips_cost = solve_cost({**short, "commands": short["reads"]},
                            {**long, "commands": long["reads"]})
    round_trips = {"per_request": trips_cost.commands_per_request,
                   "per_token": trips_cost.commands_per_token}
    print(f"idle: {idle['cpu_s'] / idle['seconds'] * 1e3:.1f} ms CPU/s, "
          f"{idle['commands'] / idle['seconds']:.0f} commands/s (subtracted)")
    for name, run in (("short", short), ("long", long)):
        print(f"{name} run: {run['requests']:.0f} requests, {run['tokens']:.0f} tokens in "
              f"{run['seconds']:.1f} s: Redis {run['cpu_s']:.3f} CPU s, "
              f"{run['commands']:.0f} commands")
    plans = [plan_redis(cost, output_tpm=d, tokens_per_request=args.tokens_per_request)
             for d in args.demand_tpm]
    print(render_redis_text(cost, plans))
    print(f"round trips (Redis read events): {round_trips['per_request']:.2f} per request, "
          f"{round_trips['per_token']:.3f} per token")
    if trips:
        print(f"client commands (round trips at most): {trips['per_request']:.2f} per request, "
              f"{trips['per_token']:.3f} per token")
    out = {"cost": cost.__dict__, "short": short, "long": long, "idle": idle, "trips": trips,
           "round_trips": round_trips,
           "plans": [p.__dict__ for p in plans]}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


def measure_trips(system: System, args: argparse.Namespace) -> dict[str, float]:
    """Client commands per request and per token (MONITOR; see the module docstring)."""
    if args.trips_requests <= 0:
        return {}
    mon = Monitor(os.environ["REDIS_URL"])
    time.sleep(0.5)
    before, at = mon.total(), time.perf_counter()
    time.sleep(2.0)
    idle_per_s = (mon.total() - before) / (time.perf_counter() - at)
    n = args.trips_requests
    short = trips_phase(system, mon, n, args.short, args.concurrency, idle_per_s)
    long = trips_phase(system, mon, n, args.long, args.concurrency, idle_per_s)
    solved = solve_cost({**short, "cpu_s": 1.0}, {**long, "cpu_s": 1.0})
    return {"per_request": solved.commands_per_request, "per_token": solved.commands_per_token,
            "idle_per_s": idle_per_s}


def ab(args: argparse.Namespace) -> None:
    """This file in ``--baseline``'s checkout (its code and processes), then here; the ratio."""
    base = Path(args.baseline).resolve()
    copy = base / "bench" / "_redis_cost_ab.py"
    shutil.copy(__file__, copy)
    # The Redis starter it imports, for a baseline older than it (removed afterwards).
    starter = base / "tests" / "redis_procs.py"
    lent = not starter.exists()
    if lent:
        shutil.copy(ROOT / "tests" / "redis_procs.py", starter)
    with tempfile.TemporaryDirectory() as tmp:
        outs = []
        for root, script in ((base, copy), (ROOT, Path(__file__).resolve())):
            path = Path(tmp) / f"{len(outs)}.json"
            argv = [a for a in sys.argv[1:] if a != "--baseline" and a != args.baseline]
            print(f"== {root}", flush=True)
            # This checkout's code first; other entries (not a checkout) are kept.
            rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                    if p and Path(p).resolve() not in (ROOT, base)]
            subprocess.run([sys.executable, str(script), *argv, "--json", str(path)],
                           check=True, cwd=root,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *rest])})
            outs.append(json.loads(path.read_text()))
    copy.unlink()
    if lent:
        starter.unlink()
    REDIS_PROC.stop()
    print_ab(outs[0], outs[1])


def print_ab(base: dict[str, Any], new: dict[str, Any]) -> None:
    rows = [("Redis CPU per request, us", "cost", "cpu_s_per_request", 1e6),
            ("Redis CPU per token, us", "cost", "cpu_s_per_token", 1e6),
            ("Redis commands per request (Lua's included)", "cost", "commands_per_request", 1),
            ("Redis commands per token (Lua's included)", "cost", "commands_per_token", 1),
            ("client commands per request (round trips at most)", "trips", "per_request", 1),
            ("client commands per token", "trips", "per_token", 1),
            ("round trips per request (Redis read events)", "round_trips", "per_request", 1),
            ("round trips per token (Redis read events)", "round_trips", "per_token", 1)]
    print(f"{'':52} {'baseline':>10} {'this':>10} {'this/base':>10}")
    for label, part, name, scale in rows:
        b, n = base.get(part, {}).get(name), new.get(part, {}).get(name)
        if b is None or n is None:
            continue
        ratio = f"{n / b:.2f}" if b else "-"
        print(f"{label:52} {b * scale:10.3f} {n * scale:10.3f} {ratio:>10}")
    for pb, pn in zip(base.get("plans", []), new.get("plans", []), strict=False):
        label = f"plan_redis at {pb['output_tpm']:.0e} tokens/min: Redis cores (shards)"
        print(f"{label:52} {pb['redis_cores']:6.2f} ({pb['shards']}) {pn['redis_cores']:6.2f} "
              f"({pn['shards']}) {pn['redis_cores'] / pb['redis_cores']:10.2f}")


if __name__ == "__main__":
    main()
