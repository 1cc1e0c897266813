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

from gateway.redis_conn import get_redis, key  # noqa: E402
from tenants.keys import issue_key  # noqa: E402
from tenants.models import Pool, Quota, ServedModel, Tenant, Tier  # noqa: E402
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
                 uvicorn_args: list[str] | None = None) -> None:
        self.model_name, self.pool_name = model, pool
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
            procs.wait_for_worker(r, self.pool_name, wid, proc)
        for _ in range(self.n_gateways):
            proc, url = procs.start_uvicorn(env=self.env)
            self.procs.append(proc)
            procs.wait_for_http(url + "/healthz", proc)
            self.urls.append(url)
            self.gateway_pids.append(proc.pid)
        return self

    def _rows(self) -> None:
        self._cleanup_rows()
        model = ServedModel.objects.create(name=self.model_name, engine_model_id="sim",
                                           max_model_len=8192)
        Pool.objects.create(name=self.pool_name, model=model, max_sequences=self.max_sequences,
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
        raw = get_redis().lrange(key("usage", "pending"), 0, -1)
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


async def sse_post(url: str, api_key: str, body: dict[str, Any], *,
                   close_after_events: int | None = None) -> Result:
    """POST a streaming request and read it to the end (or hang up after N token events)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    out = Result(started=time.perf_counter())
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError as exc:
        out.error = type(exc).__name__
        return out
    writer.write(head + payload)
    tail = b""
    try:
        status_line = await reader.readline()
        out.status = int(status_line.split()[1])
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"x-request-id:"):
                out.request_id = line.split(b":", 1)[1].strip().decode()
        while chunk := await reader.read(65536):
            n = chunk.count(b"\nid: ")
            if n and out.first_token is None:
                out.first_token = time.perf_counter()
            out.events += n
            tail = (tail + chunk)[-4096:]
            if close_after_events is not None and out.events >= close_after_events:
                break
    except (OSError, ValueError, IndexError) as exc:
        out.error = type(exc).__name__
    finally:
        out.ended = time.perf_counter()
        writer.close()
    found = _USAGE.findall(tail)
    if found:
        out.completion_tokens = int(found[-1])
    if b'{"error"' in tail:
        code = re.search(rb'"code": ?"([^"]*)"', tail[tail.rfind(b'{"error"'):])
        out.error = out.error or (code.group(1).decode() if code else "stream_error")
    return out


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
