"""Shared pieces of the fault tests (tests/test_faults_*.py) and bench/faults.py.

- ``stream_many``: N concurrent streaming chat requests over raw HTTP/SSE, each outcome
  recorded (status, request id, tokens seen, error code, when it ended);
- ``TcpProxy``: a tiny asyncio TCP proxy in a thread (in front of PostgreSQL) that a test can
  cut and restore, so a "database outage" never touches the shared server;
- ``baseline``: every counter that must return to zero once everything has settled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests import procs, rkeys

RETRYABLE = {"worker_lost", "service_unavailable", "state_lost", "engine_error",
             "engine_invalid_output", "worker_shutdown", "unavailable", "server_shutdown"}


@dataclass
class Outcome:
    status: int = 0
    rid: str | None = None
    tokens: int = 0  # content deltas received
    error: str | None = None
    finish: str | None = None
    usage: dict[str, int] | None = None
    started: float = 0.0
    first_token: float | None = None
    ended: float = 0.0
    last_event_id: str | None = None
    entry_ids: list[str] = field(default_factory=list)  # stream entry ids, from the SSE ids

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.finish is not None and self.error is None


async def one_stream(client: httpx.AsyncClient, url: str, plain: str, body: dict[str, Any],
                     started: asyncio.Event | None = None, resume: str | None = None,
                     out: Outcome | None = None) -> Outcome:
    """One streaming request; ``resume``: a Last-Event-ID to continue a stream from; ``out``:
    the outcome to fill in as events arrive (another thread may watch it)."""
    out = out if out is not None else Outcome()
    out.started = time.monotonic()
    headers = {"Authorization": f"Bearer {plain}"}
    if resume:
        headers["Last-Event-ID"] = resume
    body = {"stream": True, "stream_options": {"include_usage": True}, **body}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                 headers=headers) as r:
            out.status, out.rid = r.status_code, r.headers.get("x-request-id")
            if r.status_code != 200:
                data = json.loads(await r.aread() or b"{}")
                out.error = (data.get("error") or {}).get("code") or f"http_{r.status_code}"
                return out
            async for line in r.aiter_lines():
                if line.startswith("id: "):
                    out.last_event_id = line[4:]
                    out.entry_ids.append(line[4:].rpartition("/")[2])
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    out.error = data["error"].get("code") or "error"
                    return out
                if data.get("usage"):
                    out.usage = data["usage"]
                for choice in data.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        out.tokens += 1
                        if out.first_token is None:
                            out.first_token = time.monotonic()
                            if started is not None:
                                started.set()
                    if choice.get("finish_reason"):
                        out.finish = choice["finish_reason"]
    except httpx.HTTPError as exc:
        out.error = out.error or f"transport:{type(exc).__name__}"
    finally:
        out.ended = time.monotonic()
    return out


def chat(url: str, plain: str, *, model: str, max_tokens: int = 5,
         timeout: float = 10.0) -> httpx.Response:
    """One short non-streaming chat completion, as a client under a fault would send it."""
    return httpx.post(url + "/v1/chat/completions", timeout=timeout,
                      headers={"Authorization": f"Bearer {plain}"},
                      json={"model": model, "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": "Hi"}]})


def stream_many(url: str, plain: str | list[str], body: dict[str, Any], n: int, *,
                during: Any = None, timeout: float = 60.0) -> tuple[list[Outcome], Any]:
    """Run ``n`` streams at once; ``during(outcomes_so_far)`` runs in a thread meanwhile."""
    keys = plain if isinstance(plain, list) else [plain]

    async def main() -> tuple[list[Outcome], Any]:
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            tasks = [asyncio.create_task(one_stream(client, url, keys[i % len(keys)], body))
                     for i in range(n)]
            side = (asyncio.create_task(asyncio.to_thread(during, tasks))
                    if during is not None else None)
            results = await asyncio.gather(*tasks)
            return list(results), (await side if side is not None else None)

    return procs.arun(main())


def hang_up_after(url: str, plain: str, body: dict[str, Any], events: int,
                  timeout: float = 30.0) -> str:
    """Stream ``body`` and hang up after ``events`` SSE events (a client gone mid-stream);
    returns the request id."""
    with httpx.Client(timeout=timeout) as http, http.stream(
            "POST", url + "/v1/chat/completions", json=body,
            headers={"Authorization": f"Bearer {plain}"}) as resp:
        seen = 0
        for line in resp.iter_lines():
            seen += line.startswith("id: ")
            if seen >= events:
                break
        return str(resp.headers["x-request-id"])


def stream_one(url: str, plain: str, body: dict[str, Any], out: Outcome | None = None,
               timeout: float = 60.0) -> Outcome:
    """One stream, filling in ``out`` (when given) as it goes."""
    async def main() -> Outcome:
        async with httpx.AsyncClient(timeout=timeout) as client:
            return await one_stream(client, url, plain, body, out=out)

    return procs.arun(main())


def settled_records(r: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for rec in rkeys.usage_records(r):
        assert rec["request_id"] not in out, f"two records for {rec['request_id']}"
        out[rec["request_id"]] = rec
    return out


def entry_ids(r: Any, rid: str) -> list[str]:
    return [i.decode() for i, _ in r.xrange(rkeys.find_stream(r, rid))]


def wait_quiet(r: Any, pool: str, worker_ids: list[str], timeout: float = 5.0) -> dict[str, Any]:
    """Pool leftovers once the workers' heartbeat snapshots caught up (or as they are then)."""
    with contextlib.suppress(AssertionError):
        procs.wait_until(lambda: not any(pool_leftovers(r, pool, worker_ids).values()),
                         timeout, "pool state back to zero")
    return pool_leftovers(r, pool, worker_ids)


def stream_tokens(r: Any, rid: str) -> int:
    return sum(int(f.get(b"n", 0)) for _, f in r.xrange(rkeys.find_stream(r, rid)))


def terminal_entries(r: Any, rid: str) -> list[dict[bytes, bytes]]:
    return [f for _, f in r.xrange(rkeys.find_stream(r, rid)) if b"f" in f or b"e" in f]


def nonzero_counters(r: Any, tenants: list[Any], keys: list[Any]) -> dict[str, int]:
    names = [rkeys.counter_key(kind, t.pk) for t in tenants for kind in ("conc", "streams")]
    names += [rkeys.counter_key(kind, k.tenant_id, "key", k.pk) for k in keys
              for kind in ("conc", "streams")]
    values = {n: int(r.get(n) or 0) for n in names}
    return {n: v for n, v in values.items() if v}


def pool_leftovers(r: Any, pool: str, worker_ids: list[str]) -> dict[str, Any]:
    """Queues, in-flight sets and reserved KV that must be empty once nothing runs."""
    out: dict[str, Any] = {
        "queued": r.hlen(rkeys.pool_key("wfq", pool, "items")),
        "deadlines": r.zcard(rkeys.pool_key("deadlines", pool)),
    }
    for wid in worker_ids:
        out[f"{wid}:inflight"] = r.scard(rkeys.inflight_key(pool, wid))
        load = r.hgetall(rkeys.worker_key(pool, wid, "load"))
        out[f"{wid}:kv_reserved"] = int(load.get(b"kv_tokens_reserved", 0) or 0)
        out[f"{wid}:running"] = int(load.get(b"in_flight", 0) or 0)
    return out


def table(title: str, rows: list[tuple[str, Any]]) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [f"== {title} ==", *(f"  {k:<{width}}  {v}" for k, v in rows)]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- a private Redis ----------------------------------------------------------------------


# -- a TCP proxy that can be cut ------------------------------------------------------------


@dataclass
class TcpProxy:
    """127.0.0.1:<port> -> target; ``cut()`` drops every connection and refuses new ones."""

    target_host: str
    target_port: int
    port: int = field(default_factory=procs.free_port)
    _loop: asyncio.AbstractEventLoop | None = None
    _server: asyncio.AbstractServer | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    def start(self) -> TcpProxy:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._listen())
            ready.set()
            self._loop.run_forever()

        threading.Thread(target=run, daemon=True, name="tcp-proxy").start()
        ready.wait(5)
        return self

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", self.port)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_w}
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    def _call(self, coro_fn: Any) -> None:
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(coro_fn(), self._loop).result(5)

    def cut(self) -> None:
        async def cut() -> None:
            server, self._server = self._server, None
            if server is not None:
                server.close()
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()
            if server is not None:
                await server.wait_closed()

        self._call(cut)

    def restore(self) -> None:
        self._call(self._listen)

    def close(self) -> None:
        self.cut()
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
