"""A/B: the previous main and the working tree, side by side in one run, under the same load.

Each side gets its own processes, started from its own checkout (``git worktree add`` of
``--base`` into a temporary directory; the working tree as it is): a private ``redis-server``
(so ``INFO`` counts only that side), the zero-delay upstream (``bench/zero_upstream.py``, one
chunk per token), a pool worker whose pool is ``openai_upstream`` on the generic (``openai``)
dialect, and a uvicorn gateway. Both sides share the database (their own pool, model and
tenant rows). The load is open loop: streaming completions of ``--tokens`` tokens arriving at
each ``--rates`` rate for ``--seconds``; the sides take turns at each rate (the order
alternates), never loading the cores at the same time.

Per side and rate it prints the CPU per request of each process (gateway, worker, Redis,
upstream), idle CPU subtracted (measured before the load), the Redis commands per request
(``INFO commandstats``, commands inside scripts included), TTFT p50/p99 at the client, and the
admission p99 (the client's send to the request's ``admitted_at`` stamp in Redis: millisecond
resolution). Then: the Redis round trips per request and per token (a ``MONITOR`` sample of
one request at a time, 1 and ``--tokens`` tokens: commands sent by clients, not by scripts),
the highest rate whose TTFT p99 stayed under 50 ms, and the targets of issue 30 with the
ratio new/base and PASS/OVER.

    python bench/ab.py                          # base = main, rates 50,100,200,300
    python bench/ab.py --base 443da38 --rates 50,100,200,300,400 --seconds 6
    python bench/ab.py --base HEAD~3 --only new # one side (no A/B): a quick look

Needs PostgreSQL (``DATABASE_URL``) and ``redis-server`` on the PATH. Everything (both sides,
the upstreams and the load generator) shares this machine's cores: CPU figures are CPU time,
robust to other load; latencies are not, so compare the two sides of one run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# Production mode (DEBUG off) with the test suite's secrets, before Django reads its settings.
importlib.import_module("tests.testenv")

from _http import ROOT, percentile, run_async, sse_post, stream_body  # noqa: E402

from catalog.models import Pool, ServedModel  # noqa: E402
from tenants.api_keys import issue_key  # noqa: E402
from tenants.models import Quota, Tenant, Tier  # noqa: E402
from tests.procs import free_port, wait_until  # noqa: E402

QUOTA = {"input_tpm": 10**9, "output_tpm": 10**9, "concurrent_requests": 100_000,
         "open_streams": 100_000, "ttft_deadline_s": 60, "total_deadline_s": 600}
OWN_COMMANDS = {"info", "config", "monitor", "ping", "scan", "lrange", "type"}
TTFT_LIMIT_S = 0.050
# Issue 30's targets, per 32-token request through an upstream pool.
TARGET_GW_WORKER_MS = 4.0
TARGET_REDIS_MS = 0.5
TARGET_UPSTREAM_RATIO = 2.5
TARGET_RATE = 300.0


def body_for(model: str, tokens: int) -> dict[str, Any]:
    """A streamed chat request of ``tokens`` tokens (the generic dialect has no ignore_eos:
    the zero-delay upstream always streams max_tokens)."""
    body = stream_body(model, tokens)
    body.pop("ignore_eos")
    return body


def _proc_tree_cpu(pid: int) -> float:
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


_NO_EDITABLE = """import sys
# Only this side's checkout: an editable install's finder would fill in the modules this
# checkout lacks (a newer package, a newer admin module) from the tree the venv was made from.
sys.meta_path[:] = [f for f in sys.meta_path
                    if not getattr(f, "__module__", "").startswith("__editable__")]
"""


def _own_code_only() -> str:
    """A directory holding a ``sitecustomize`` that drops the editable install's finder."""
    where = Path(tempfile.gettempdir()) / "ab-own-code-only"
    where.mkdir(exist_ok=True)
    (where / "sitecustomize.py").write_text(_NO_EDITABLE)
    return str(where)


@dataclass
class Side:
    name: str
    root: Path
    db_url: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    url: str = ""
    api_key: str = ""
    redis: Any = None
    tag: str = ""
    last_try: str = ""  # how the last start-up probe ended

    @property
    def model(self) -> str:
        return f"ab-{self.tag}"

    def _start(self, what: str, args: list[str], env: dict[str, str] | None = None,
               cwd: Path | None = None) -> subprocess.Popen[bytes]:
        log = Path(tempfile.mkstemp(prefix=f"ab-{self.name}-{what}-", suffix=".log")[1])
        self.logs[what] = log
        proc = subprocess.Popen(args, cwd=cwd or self.root, env=env, start_new_session=True,
                                stdout=log.open("wb"), stderr=subprocess.STDOUT)
        self.procs[what] = proc
        return proc

    def start(self) -> None:
        self.tag = f"{self.name}-{uuid.uuid4().hex[:4]}"
        rport, uport, gport = free_port(), free_port(), free_port()
        workdir = tempfile.mkdtemp(prefix="ab-redis-")
        self._start("redis", ["redis-server", "--port", str(rport), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--dir", workdir])
        self.redis = redis.Redis(port=rport)
        wait_until(self._pings, 10, "redis-server")
        # The same upstream for both sides: the working tree's.
        self._start("upstream", [sys.executable, str(ROOT / "bench" / "zero_upstream.py"),
                                 "--port", str(uport), "--model", "up"], cwd=ROOT)
        self._rows(uport)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(self.root), _own_code_only()]),
               "DATABASE_URL": self.db_url,
               "REDIS_URL": f"redis://127.0.0.1:{rport}/0", "REDIS_KEY_PREFIX": "ab",
               "LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
               "DJANGO_SETTINGS_MODULE": "gateway.settings"}
        wid = f"{self.tag}-w0"
        self._start("worker", [sys.executable, "-m", "celery", "-A", "gateway", "worker",
                               "--engine-pool", self.tag, "--engine-worker-id", wid,
                               "-P", "solo", "-c", "1", "-l", "warning", "-n", f"{wid}@%h",
                               "--without-mingle", "--without-gossip", "--without-heartbeat"],
                    env)
        self._start("gateway", [sys.executable, "-m", "infra.uvicorn_command", "--host",
                                "127.0.0.1", "--port", str(gport), "--log-level", "warning"],
                    env)
        self.url = f"http://127.0.0.1:{gport}"
        try:
            wait_until(self._serves, 120, f"{self.name}: a first completion", interval=0.5)
        except AssertionError:
            raise SystemExit(f"{self.name}: no completion; the last try: {self.last_try}; "
                             f"logs: {self.logs}") from None

    def _pings(self) -> bool:
        with contextlib.suppress(redis.RedisError):
            return bool(self.redis.ping())
        return False

    def _serves(self) -> bool:
        for what, proc in self.procs.items():
            if proc.poll() is not None:
                raise SystemExit(f"{self.name}: {what} exited:\n"
                                 f"{self.logs[what].read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            res = run_async(sse_post(self.url, self.api_key, body_for(self.model, 2)))
            self.last_try = f"{res.status} {res.error}"
            return res.status == 200 and not res.error
        return False

    def _rows(self, uport: int) -> None:
        model = ServedModel.objects.create(name=self.model, engine_model_id="up",
                                           max_model_len=8192)
        Pool.objects.create(name=self.tag, model=model, backend="openai_upstream",
                            max_sequences=512, kv_cache_tokens=10**7, backend_settings={
                                "base_url": f"http://127.0.0.1:{uport}/v1", "model": "up",
                                "dialect": "openai", "send_cache_salt": True,
                                "max_connections": 512})
        tier = Tier.objects.create(name=f"ab-{self.tag}", weight=1.0)
        tenant = Tenant.objects.create(name=self.tag, slug=f"ab-{self.tag}", tier=tier)
        Quota.objects.create(tenant=tenant, **QUOTA)
        self.api_key = issue_key(tenant, "ab")[1]

    def cpu(self) -> dict[str, float]:
        out = {what: _proc_tree_cpu(p.pid) for what, p in self.procs.items() if what != "redis"}
        info = self.redis.info("cpu")
        out["redis"] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        return out

    def calls(self) -> dict[str, int]:
        stats = self.redis.info("commandstats")
        return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}

    def usage_records(self) -> dict[str, dict[str, Any]]:
        """The settled requests' usage records, by request id (whatever list holds them)."""
        found: dict[str, dict[str, Any]] = {}
        for name in self.redis.scan_iter(count=1000):
            if b"pending" not in name or self.redis.type(name) != b"list":
                continue
            for raw in self.redis.lrange(name, 0, -1):
                with contextlib.suppress(ValueError):
                    rec = json.loads(raw)
                    if isinstance(rec, dict) and "request_id" in rec:
                        found[rec["request_id"]] = rec
        return found

    def stop(self) -> None:
        for what in ("gateway", "worker", "upstream", "redis"):
            proc = self.procs.get(what)
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 15)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
        Tenant.objects.filter(slug=f"ab-{self.tag}").delete()
        Tier.objects.filter(name=f"ab-{self.tag}").delete()
        Pool.objects.filter(name=self.tag).delete()
        ServedModel.objects.filter(name=self.model).delete()


@dataclass
class Phase:
    side: str
    rate: float
    requests: int
    achieved: float
    failed: int
    ttft: list[float]
    admission: list[float]
    cpu_ms: dict[str, float]  # per request, idle subtracted
    commands: float  # per request (scripts' own calls included)
    top: str = ""  # the commands that grew most, per request


async def _open_loop(side: Side, rate: float, seconds: float, tokens: int) -> list[Any]:
    body = body_for(side.model, tokens)
    start = time.perf_counter()
    sent: list[tuple[float, Any]] = []
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent.append((time.time(), asyncio.create_task(sse_post(side.url, side.api_key, body))))
    return [(wall, await task) for wall, task in sent]


def measure_idle(side: Side, seconds: float) -> dict[str, float]:
    before, t0 = side.cpu(), time.perf_counter()
    time.sleep(seconds)
    after, wall = side.cpu(), time.perf_counter() - t0
    return {k: (after[k] - before[k]) / wall for k in after}


def run_phase(side: Side, rate: float, seconds: float, tokens: int,
              idle: dict[str, float], py_spy: str | None = None) -> Phase:
    spies = [subprocess.Popen([py_spy, "record", "--nonblocking", "--format", "raw", "-r", "200",
                               "-d", str(int(seconds)), "-o", f"/tmp/ab-{side.name}-{what}.txt",
                               "-p", str(side.procs[what].pid)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for what in ("gateway", "worker")] if py_spy else []
    cpu0, calls0, t0 = side.cpu(), side.calls(), time.perf_counter()
    results = run_async(_open_loop(side, rate, seconds, tokens))
    for spy in spies:
        spy.wait(30)
    wall = time.perf_counter() - t0
    cpu1, calls1 = side.cpu(), side.calls()
    n = len(results)
    cpu_ms = {k: max(0.0, cpu1[k] - cpu0[k] - idle[k] * wall) / n * 1e3 for k in cpu1}
    grew = {k: (v - calls0.get(k, 0)) / n for k, v in calls1.items() if k not in OWN_COMMANDS}
    commands = sum(grew.values())
    top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(grew.items(), key=lambda kv: -kv[1])[:8])
    records = side.usage_records()
    ok = [(w, r) for w, r in results if r.status == 200 and not r.error and r.ttft is not None]
    admission = []
    for wall_sent, res in ok:
        rec = records.get(res.request_id) or {}
        if rec.get("admitted_at_ms") is not None:
            admission.append(max(0.0, rec["admitted_at_ms"] / 1e3 - wall_sent))
    return Phase(side.name, rate, n, n / wall, n - len(ok), [r.ttft for _, r in ok],
                 admission, cpu_ms, commands, top)


def monitor_sample(side: Side, tokens: int, n: int = 10) -> dict[str, Any]:
    """Commands sent by clients (not by scripts) per request, one request at a time, from a
    MONITOR stream; the background commands of an idle second are subtracted. ``by_command``:
    the same per command name (a script by its first key's kind), to see where they go."""
    def count(work: Any, seconds: float | None = None) -> tuple[Counter[str], float]:
        sock = socket.create_connection(("127.0.0.1", side.redis.connection_pool
                                         .connection_kwargs["port"]))
        sock.sendall(b"MONITOR\r\n")
        sock.settimeout(5)
        buf = sock.recv(100)  # +OK
        t0, began = time.perf_counter(), time.time()
        if seconds is not None:
            time.sleep(seconds)
        else:
            work()
        wall, ended = time.perf_counter() - t0, time.time()
        time.sleep(0.05)
        sock.settimeout(0.1)
        chunks = [buf]
        until = time.perf_counter() + 0.3  # heartbeats never let the stream go quiet
        with contextlib.suppress(TimeoutError, socket.timeout):
            while time.perf_counter() < until:
                data = sock.recv(1 << 20)
                if not data:
                    break
                chunks.append(data)
        sock.close()
        top: Counter[str] = Counter()
        for line in b"".join(chunks).split(b"\r\n"):
            stamp = re.match(rb"\+(\d+\.\d+) \[", line)
            if (stamp and began <= float(stamp.group(1)) <= ended and b" lua]" not in line
                    and not re.search(rb'"(?:info|ping|monitor)"', line, re.I)):
                top[command_name(line)] += 1
        return top, wall

    idle, idle_wall = count(None, 1.0)

    def work() -> None:
        for _ in range(n):
            run_async(sse_post(side.url, side.api_key, body_for(side.model, tokens)))

    busy, wall = count(work)
    by_command = {name: max(0.0, busy[name] - idle[name] / idle_wall * wall) / n
                  for name in busy | idle}
    return {"per_request": max(0.0, sum(busy.values()) - sum(idle.values()) / idle_wall * wall)
            / n, "by_command": {k: v for k, v in by_command.items() if v >= 0.05}}


def command_name(line: bytes) -> str:
    """A MONITOR line's command, and for a script call the kind of its first key
    (``evalsha req``), so scripts can be told apart without their SHA."""
    words = re.findall(rb'"((?:[^"\\]|\\.)*)"', line)
    if not words:
        return "?"
    name = words[0].decode(errors="replace").lower()
    if name in ("evalsha", "eval", "fcall") and len(words) > 3:
        parts = words[3].decode(errors="replace").split(":")
        name += " " + (parts[1] if len(parts) > 1 else parts[0])
    return name


def base_checkout(ref: str) -> Path:
    where = Path(tempfile.mkdtemp(prefix="ab-base-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where / "tree"),
                    ref], check=True, capture_output=True)
    return where / "tree"


def remove_checkout(path: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                   check=False, capture_output=True)
    shutil.rmtree(path.parent, ignore_errors=True)


def fmt(v: float, spec: str = ".2f") -> str:
    return "-" if v != v else format(v, spec)  # NaN


def report(phases: list[Phase], samples: dict[str, dict[str, float]], tokens: int,
           ref_rate: float) -> None:
    print(f"\n{'side':<5} {'rate':>5} {'got/s':>6} {'fail':>4} {'TTFT p50/p99 ms':>16} "
          f"{'adm p99':>7} {'gw':>6} {'worker':>6} {'redis':>6} {'upstr':>6} {'cmd/req':>7}"
          "   (CPU ms per request, idle subtracted)")
    for p in phases:
        p50, p99 = percentile(p.ttft, .5) * 1e3, percentile(p.ttft, .99) * 1e3
        ttft = f"{fmt(p50, '7.1f')} /{fmt(p99, '7.1f')}"
        print(f"{p.side:<5} {p.rate:5.0f} {p.achieved:6.1f} {p.failed:4d} {ttft} "
              f"{fmt(percentile(p.admission, .99) * 1e3, '7.1f')} "
              f"{p.cpu_ms['gateway']:6.2f} {p.cpu_ms['worker']:6.2f} {p.cpu_ms['redis']:6.2f} "
              f"{p.cpu_ms['upstream']:6.2f} {p.commands:7.1f}")
    print("\nRedis commands per request at each rate (INFO commandstats; scripts' calls included):")
    for p in phases:
        print(f"  {p.side:<5} {p.rate:5.0f}: {p.top}")
    sides = sorted({p.side for p in phases}, key=lambda s: s != "base")

    def at_ref(side: str) -> Phase | None:
        mine = [p for p in phases if p.side == side]
        return min(mine, key=lambda p: abs(p.rate - ref_rate)) if mine else None

    def best_rate(side: str) -> float:
        ok = [p.rate for p in phases if p.side == side and not p.failed
              and percentile(p.ttft, .99) < TTFT_LIMIT_S]
        return max(ok) if ok else 0.0

    rows: list[tuple[str, dict[str, float], str, Any]] = []
    vals: dict[str, dict[str, float]] = {}
    for s in sides:
        here = at_ref(s)
        assert here is not None
        mine = [q for q in phases if q.side == s]

        def cpu(*what: str, mine: list[Phase] = mine) -> float:
            """Median over the rates run: one rate's figure swings with the machine's load."""
            return statistics.median(sum(q.cpu_ms[w] for w in what) for q in mine)

        gw_wk = cpu("gateway", "worker")
        sample = samples.get(s, {})
        vals[s] = {
            "gw+worker CPU ms/req": gw_wk,
            "Redis CPU ms/req": cpu("redis"),
            "upstream CPU ms/req": cpu("upstream"),
            "(gw+worker+Redis)/upstream": cpu("gateway", "worker", "redis") / max(
                cpu("upstream"), 1e-9),
            "Redis commands/req": statistics.median(q.commands for q in mine),
            "Redis round trips/req": sample.get("rt_request", float("nan")),
            "Redis round trips/token": sample.get("rt_token", float("nan")),
            "TTFT p50 ms": percentile(here.ttft, .5) * 1e3,
            "TTFT p99 ms": percentile(here.ttft, .99) * 1e3,
            "admission p99 ms": percentile(here.admission, .99) * 1e3,
            "best rate, TTFT p99<50ms": best_rate(s),
        }
    targets: dict[str, tuple[str, Any]] = {
        "gw+worker CPU ms/req": (f"<= {TARGET_GW_WORKER_MS}", lambda v: v <= TARGET_GW_WORKER_MS),
        "Redis CPU ms/req": (f"<= {TARGET_REDIS_MS}", lambda v: v <= TARGET_REDIS_MS),
        "(gw+worker+Redis)/upstream": (f"<= {TARGET_UPSTREAM_RATIO}",
                                       lambda v: v <= TARGET_UPSTREAM_RATIO),
        "Redis round trips/req": ("<= 5", lambda v: v <= 5),
        "Redis round trips/token": ("<= 1", lambda v: v <= 1.0),
        "admission p99 ms": ("< 1", lambda v: v < 1),
        "best rate, TTFT p99<50ms": (f">= {TARGET_RATE:.0f}", lambda v: v >= TARGET_RATE),
    }
    ref = at_ref(sides[-1])
    print(f"\nsummary, {tokens} tokens per request: CPU and commands are medians over the rates "
          f"run, TTFT and admission at {ref.rate if ref else ref_rate:.0f} req/s, the best rate "
          "over all rates run")
    head = f"{'metric':<28}" + "".join(f"{s:>10}" for s in sides)
    if len(sides) == 2:
        head += f"{'new/base':>10}"
    print(head + f"{'target':>10} {'':>5}")
    for metric in vals[sides[0]]:
        line = f"{metric:<28}" + "".join(f"{fmt(vals[s][metric]):>10}" for s in sides)
        if len(sides) == 2:
            a, b = vals[sides[0]][metric], vals[sides[1]][metric]
            line += f"{fmt(b / a if a else float('nan')):>10}"
        if metric in targets:
            text, check = targets[metric]
            v = vals[sides[-1]][metric]
            line += f"{text:>10} {'-' if v != v else ('PASS' if check(v) else 'OVER'):>5}"
        print(line)
    del rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="main", help="git ref of the previous build")
    parser.add_argument("--rates", default="50,100,200,300")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--ref-rate", type=float, default=100.0,
                        help="the rate whose CPU figures the summary compares")
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    parser.add_argument("--only", choices=("base", "new"))
    parser.add_argument("--py-spy", metavar="PATH",
                        help="py-spy binary: profile gateway and worker at --ref-rate "
                             "(collapsed stacks in /tmp/ab-SIDE-PROCESS.txt)")
    args = parser.parse_args()
    from django.db import connection

    db = connection.settings_dict
    db_url = (f"postgres://{db['USER']}{':' + db['PASSWORD'] if db.get('PASSWORD') else ''}"
              f"@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}")
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    checkout = None if args.only == "new" else base_checkout(args.base)
    sides = []
    if checkout is not None:
        sides.append(Side("base", checkout, db_url))
    if args.only != "base":
        sides.append(Side("new", ROOT, db_url))
    phases: list[Phase] = []
    samples: dict[str, dict[str, float]] = {}
    try:
        for side in sides:
            side.start()
            print(f"{side.name}: {side.root} up at {side.url}", flush=True)
        idle = {}
        for side in sides:
            run_async(_open_loop(side, 20, 1, args.tokens))  # warm up
            idle[side.name] = measure_idle(side, args.idle_seconds)
            print(f"{side.name} idle CPU ms/s: " + ", ".join(
                f"{k} {v * 1e3:.1f}" for k, v in idle[side.name].items()), flush=True)
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            for side in (sides if i % 2 == 0 else sides[::-1]):
                spy = args.py_spy if rate == args.ref_rate else None
                phase = run_phase(side, rate, args.seconds, args.tokens, idle[side.name], spy)
                phases.append(phase)
                print(f"  {side.name} {rate:.0f}/s: TTFT p99 "
                      f"{percentile(phase.ttft, .99) * 1e3:.1f} ms, gw+worker "
                      f"{phase.cpu_ms['gateway'] + phase.cpu_ms['worker']:.2f} ms/req",
                      flush=True)
                time.sleep(1.0)  # let the last streams settle
        for side in sides:
            one = monitor_sample(side, 1)["per_request"]
            sample = monitor_sample(side, args.tokens)
            full = sample["per_request"]
            samples[side.name] = {"rt_request": full,
                                  "rt_token": max(0.0, full - one) / max(1, args.tokens - 1)}
            print(f"{side.name}: client commands per {args.tokens}-token request: " + ", ".join(
                f"{k} {v:.1f}" for k, v in sorted(sample["by_command"].items(),
                                                  key=lambda kv: -kv[1])), flush=True)
    finally:
        for side in sides:
            side.stop()
        if checkout is not None:
            remove_checkout(checkout)
    report(phases, samples, args.tokens, args.ref_rate)
    print("\n(one machine for both sides, the upstream and the load generator; "
          "CPU is CPU time, latencies share the cores)")


if __name__ == "__main__":
    main()
