"""Shared pieces of the HTTP benchmarks: the running system and a lean SSE client.

``System`` starts what a deployment runs (uvicorn gateways and Celery pool workers hosting the
simulated engine, from ``tests.procs``), on the database in ``DATABASE_URL`` and the Redis in
``REDIS_URL`` (a private key prefix per run, so nothing else is disturbed), and creates the
model, pools, tenants and keys a benchmark asks for; it removes them again at the end.

The client speaks just enough HTTP/1.1 to post a request and watch its SSE stream: a thousand
``httpx`` streams would spend the shared CPUs on the client rather than on the gateway.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gateway.settings")
os.environ.setdefault("REDIS_KEY_PREFIX", f"bench-{uuid.uuid4().hex[:6]}")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402

from catalog.models import Pool, ServedModel  # noqa: E402
from infra.redis_conn import get_redis, key  # noqa: E402
from metering.keys import pending_key, pool_names  # noqa: E402
from tenants.api_keys import issue_key  # noqa: E402
from tenants.models import Quota, Tenant, Tier  # noqa: E402
from tests import procs  # noqa: E402

_USAGE = re.compile(rb'"completion_tokens":(\d+)')


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary_ms(values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    if not ms:
        return "-"
    return (f"p50 {statistics.median(ms):7.1f}  p95 {percentile(ms, 0.95):7.1f}  "
            f"p99 {percentile(ms, 0.99):7.1f}  max {max(ms):7.1f} ms")


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (uvicorn is one process here)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class TenantSpec:
    slug: str
    weight: float = 1.0
    quota: dict[str, Any] = field(default_factory=dict)


class System:
    """Gateways and pool workers as subprocesses, plus the rows they serve."""

    def __init__(self, *, model: str = "bench-model", pool: str = "bench-pool",
                 backend_settings: dict[str, Any] | None = None, max_sequences: int = 64,
                 kv_cache_tokens: int = 381_000, tenants: list[TenantSpec] | None = None,
                 workers: int = 1, gateways: int = 1, env: dict[str, str] | None = None,
                 uvicorn_args: list[str] | None = None, max_model_len: int = 8192,
                 backend: str = "simulated", model_dir: str = "",
                 worker_timeout: float = 60.0) -> None:
        self.model_name, self.pool_name = model, pool
        self.max_model_len, self.backend, self.model_dir = max_model_len, backend, model_dir
        self.worker_timeout = worker_timeout  # a vLLM worker loads its model first: minutes
        self.backend_settings = backend_settings or {}
        self.max_sequences, self.kv_cache_tokens = max_sequences, kv_cache_tokens
        self.tenant_specs = tenants or [TenantSpec("bench")]
        self.n_workers, self.n_gateways = workers, gateways
        self.env = {"LOG_LEVEL": "WARNING", **(env or {})}
        self.keys: dict[str, str] = {}
        self.procs: list[procs.Proc] = []
        self.urls: list[str] = []
        self.gateway_pids: list[int] = []
        self.worker_procs: list[procs.Proc] = []

    def __enter__(self) -> System:
        call_command("migrate", verbosity=0)
        self._rows()
        r = get_redis()
        for i in range(self.n_workers):
            wid = f"{self.pool_name}-w{i}"
            proc = procs.start_worker(self.pool_name, worker_id=wid, env=self.env)
            self.procs.append(proc)
            self.worker_procs.append(proc)
            procs.wait_for_worker(r, self.pool_name, wid, proc, timeout=self.worker_timeout)
        for _ in range(self.n_gateways):
            proc, url = procs.start_uvicorn(env=self.env)
            self.procs.append(proc)
            procs.wait_for_http(url + "/healthz", proc)
            self.urls.append(url)
            self.gateway_pids.append(proc.pid)
        return self

    def _rows(self) -> None:
        self._cleanup_rows()
        model = ServedModel.objects.create(name=self.model_name,
                                           engine_model_id=self.model_dir or "sim",
                                           tokenizer_path=self.model_dir,
                                           max_model_len=self.max_model_len)
        Pool.objects.create(name=self.pool_name, model=model, backend=self.backend,
                            max_sequences=self.max_sequences,
                            kv_cache_tokens=self.kv_cache_tokens,
                            backend_settings=self.backend_settings)
        for spec in self.tenant_specs:
            tier = Tier.objects.create(name=f"bench-{spec.slug}", weight=spec.weight)
            tenant = Tenant.objects.create(name=spec.slug, slug=f"bench-{spec.slug}", tier=tier)
            Quota.objects.create(tenant=tenant, **spec.quota)
            _, plain = issue_key(tenant, "bench")
            self.keys[spec.slug] = plain

    def _cleanup_rows(self) -> None:
        Tenant.objects.filter(slug__startswith="bench-").delete()
        Tier.objects.filter(name__startswith="bench-").delete()
        Pool.objects.filter(name=self.pool_name).delete()
        ServedModel.objects.filter(name=self.model_name).delete()

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self._cleanup_rows()
        r = get_redis()
        for name in r.scan_iter(key("*"), count=1000):
            r.delete(name)

    def usage_records(self) -> list[dict[str, Any]]:
        r = get_redis()
        raw = [x for p in pool_names(r) for x in r.lrange(pending_key(p), 0, -1)]
        return [json.loads(x) for x in raw]


@dataclass
class Result:
    status: int = 0
    started: float = 0.0
    first_token: float | None = None
    ended: float = 0.0
    events: int = 0
    completion_tokens: int = 0
    request_id: str = ""
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started


class _SseClient(asyncio.Protocol):
    """Reads one SSE response with no per-read coroutine (a protocol's callback, not a stream)."""

    def __init__(self, out: Result, request: bytes, close_after_events: int | None,
                 tally: list[int] | None = None) -> None:
        self.out, self.request, self.close_after = out, request, close_after_events
        self.tally = tally  # a shared [events] counter, sampled for throughput over time
        self.head = b""  # response headers until they are complete
        self.in_body = False
        self.tail = b""
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if not self.in_body:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = self.head[:end], self.head[end + 4:]
            self.in_body = True
            lines = head.split(b"\r\n")
            self.out.status = int(lines[0].split()[1])
            for line in lines[1:]:
                if line.lower().startswith(b"x-request-id:"):
                    self.out.request_id = line.split(b":", 1)[1].strip().decode()
            data = b"\n" + data  # so the first event's "id:" counts like the others
        n = data.count(b"\nid: ")
        if n and self.out.first_token is None:
            self.out.first_token = time.perf_counter()
        self.out.events += n
        if self.tally is not None:
            self.tally[0] += n
        self.tail = (self.tail + data)[-4096:]
        if self.close_after is not None and self.out.events >= self.close_after:
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and not self.out.error:
            self.out.error = type(exc).__name__
        if not self.done.done():
            self.done.set_result(None)


async def sse_post(url: str, api_key: str, body: dict[str, Any], *,
                   close_after_events: int | None = None, tally: list[int] | None = None,
                   out: Result | None = None) -> Result:
    """POST a streaming request and read it to the end (or hang up after N token events).

    ``out``: fill this result (a caller that may cancel the call keeps what it got so far)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    if out is None:
        out = Result()
    out.started = time.perf_counter()
    loop = asyncio.get_running_loop()
    try:
        _, proto = await loop.create_connection(
            lambda: _SseClient(out, head + payload, close_after_events, tally), host, int(port))
    except OSError as exc:
        out.error = type(exc).__name__
        return out
    try:
        await proto.done
    finally:
        out.ended = time.perf_counter()
        if proto.transport is not None:
            proto.transport.close()
    if not out.status and not out.error:
        out.error = "no_response"
    tail = proto.tail
    found = _USAGE.findall(tail)
    if found:
        out.completion_tokens = int(found[-1])
    if b'{"error"' in tail:
        code = re.search(rb'"code": ?"([^"]*)"', tail[tail.rfind(b'{"error"'):])
        out.error = out.error or (code.group(1).decode() if code else "stream_error")
    return out


def run_async(coro: Any) -> Any:
    """``asyncio.run`` on uvloop when installed: the load generator shares the CPUs with what it
    measures, so it should spend as little of them as it can."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def redis_cpu_seconds() -> float:
    """CPU the Redis server has used so far (user + system), from INFO."""
    info = get_redis().info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def stream_body(model: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, **extra}


def maybe_plot(path: str | None, draw: Any) -> None:
    if not path:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return
    fig = draw(plt)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"plot written to {path}")
