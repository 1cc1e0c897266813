"""Token transport: worker -> one Redis stream per request -> the gateway holding the client.

Writer (worker): every engine step, the deltas of all requests that produced tokens go out in ONE
pipeline, one ``XADD stream:{rid}`` per request plus ``HINCRBY req:{rid} delivered n`` (the
janitor bills a lost request for what was delivered). A stream's last entry is written by
``settle.lua``, in the step that settles the request, so "final event" and "settled" are one.

Entry fields, short because there is one entry per request per step:

    t  text of the delta          n  token count of the delta
    f  finish reason (last entry) u  usage JSON (last entry)
    e  error code (last entry)    m  error message   r  retryable ("1"/"0")

Streams are capped (MAXLEN ~) and expire a short while after the end, so a client that
reconnects with ``Last-Event-ID`` can resume from any entry id until then.

Reader (gateway): ONE task per process (per event loop) runs a multiplexed
``XREAD BLOCK ... STREAMS k1 k2 ...`` over every open request of the process and feeds
per-request asyncio queues. A new subscription interrupts the blocked read with
``CLIENT UNBLOCK`` so its stream joins the next read at once (MEASUREMENTS.md: one reader per
process, not one blocking connection per stream, is what relays tens of thousands of tokens/s).

Cancel: the gateway publishes the request id on ``cancel:{pool}``; every worker of the pool is
subscribed and the one running it calls ``engine.abort`` (see ``gateway.submission.cancel``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from gateway.accounting import STREAM_MAXLEN, req_key, stream_key
from gateway.lua import script
from gateway.redis_conn import get_async_redis, get_redis, key, redis_url

log = logging.getLogger(__name__)

# A running request's stream expires this long after its first tokens unless settle.lua
# shortens it to the after-end window first; it bounds what a lost stream can leak. Longer than
# any total deadline (the janitor settles a request by its deadline + grace).
RUNNING_STREAM_TTL_S = 2 * 3600
READ_BLOCK_MS = 1000  # a blocked read is interrupted by new subscriptions; this is a backstop
READ_COUNT = 512  # entries per stream per read
RELAY_CLIENT_NAME = "igw-relay"  # CLIENT LIST shows one such connection per gateway loop


def cancel_channel(pool: str) -> str:
    return key("cancel", pool)


def wake_key(pool: str) -> str:
    """A list the enqueue path pushes to, so an idle worker's BLPOP returns at once."""
    return key("wake", pool)


# -- writer (worker) --------------------------------------------------------------------------


@dataclass
class StepBatch:
    """Everything one engine step produced, written in one pipeline round trip.

    Order inside the pipeline is the order of calls, so a request's last tokens always precede
    its settle (and the final entry that settle writes).
    """

    tokens: dict[str, tuple[list[str], int]] = field(default_factory=dict)
    first: set[str] = field(default_factory=set)
    settles: list[tuple[str, list[str], list[Any]]] = field(default_factory=list)

    def add(self, rid: str, text: str, n: int, *, first: bool = False) -> None:
        texts, count = self.tokens.get(rid, ([], 0))
        texts.append(text)
        self.tokens[rid] = (texts, count + n)
        if first:
            self.first.add(rid)

    def settle(self, rid: str, keys: list[str], args: list[Any]) -> None:
        self.settles.append((rid, keys, args))

    def __bool__(self) -> bool:
        return bool(self.tokens or self.settles)

    def queue(self, pipe: Any, stream_ttl: int) -> None:
        for rid, (texts, n) in self.tokens.items():
            sk = stream_key(rid)
            pipe.xadd(sk, {"t": "".join(texts), "n": n}, maxlen=STREAM_MAXLEN, approximate=True)
            pipe.hincrby(req_key(rid), "delivered", n)
            if rid in self.first:
                script("first_token").queue(pipe, [req_key(rid)], [])
                pipe.expire(sk, stream_ttl)
        for _rid, keys, args in self.settles:
            script("settle").queue(pipe, keys, args)

    async def flush(self, client: aioredis.Redis, stream_ttl: int) -> list[Any]:
        """Write the batch; returns the settle replies in the order they were added."""
        if not self:
            return []
        pipe = client.pipeline(transaction=False)
        self.queue(pipe, stream_ttl)
        replies = await pipe.execute()
        return replies[len(replies) - len(self.settles):] if self.settles else []


def error_event(code: str, message: str, *, retryable: bool) -> dict[str, str]:
    return {"e": code, "m": message, "r": "1" if retryable else "0"}


def finish_event(finish_reason: str, usage: Mapping[str, int], text: str = "",
                 n: int = 0) -> dict[str, str | int]:
    import json

    event: dict[str, str | int] = {"f": finish_reason, "u": json.dumps(dict(usage))}
    if n:
        event.update(t=text, n=n)
    return event


# -- cancel -----------------------------------------------------------------------------------


async def publish_cancel(pool: str, rid: str, reason: str = "cancelled",
                         client: aioredis.Redis | None = None) -> int:
    """Tell the pool's workers to abort ``rid``; the message is "rid<TAB>reason"."""
    message = f"{rid}\t{reason}"
    return int(await (client or get_async_redis()).publish(cancel_channel(pool), message))


def publish_cancel_sync(pool: str, rid: str, reason: str = "cancelled") -> int:
    return int(get_redis().publish(cancel_channel(pool), f"{rid}\t{reason}"))


# -- reader (gateway) -------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamEvent:
    id: str
    fields: dict[str, str]

    @property
    def terminal(self) -> bool:
        return "f" in self.fields or "e" in self.fields


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Subscription:
    """One consumer of one request's stream, fed by the process's reader."""

    def __init__(self, owner: StreamReader, rid: str, last_id: str) -> None:
        self._owner = owner
        self.rid = rid
        self.last_id = last_id
        self.queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.done = False  # the terminal entry has been queued

    def offer(self, event: StreamEvent) -> None:
        if self.done or _id_tuple(event.id) <= _id_tuple(self.last_id):
            return  # an entry this consumer already has (several consumers share one read)
        self.last_id = event.id
        self.queue.put_nowait(event)
        self.done = event.terminal

    async def next(self, timeout: float | None = None) -> StreamEvent | None:
        """The next entry, or None when ``timeout`` seconds pass first."""
        if timeout is None:
            return await self.queue.get()
        try:
            return await asyncio.wait_for(self.queue.get(), max(timeout, 0.0))
        except TimeoutError:
            return None

    def close(self) -> None:
        self._owner._remove(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamReader:
    """The one multiplexed XREAD of an event loop, serving every subscription in it."""

    def __init__(self) -> None:
        self._subs: dict[str, list[Subscription]] = {}  # stream key -> subscriptions
        self._positions: dict[str, str] = {}  # stream key -> id the next read starts after
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._conn: aioredis.Redis | None = None
        self._conn_id: int | None = None
        self._blocked = False

    # public ---------------------------------------------------------------------------------

    def open(self, rid: str, last_id: str = "0-0") -> Subscription:
        """Start receiving stream:{rid} entries after ``last_id``; close() when done."""
        sub = Subscription(self, rid, last_id)
        sk = stream_key(rid)
        self._subs.setdefault(sk, []).append(sub)
        current = self._positions.get(sk)
        if current is None or _id_tuple(last_id) < _id_tuple(current):
            self._positions[sk] = last_id
        self._ensure_running()
        self._changed.set()
        if self._blocked and self._conn_id is not None:
            # Interrupt the blocked XREAD so this stream is read now, not after READ_BLOCK_MS.
            asyncio.get_running_loop().create_task(self._unblock())
        return sub

    async def subscribe(self, rid: str, last_id: str = "0-0") -> AsyncIterator[StreamEvent]:
        """Events of stream:{rid} after ``last_id``, ending after the terminal one."""
        with self.open(rid, last_id) as sub:
            while True:
                event = await sub.next()
                assert event is not None
                yield event
                if event.terminal:
                    return

    @property
    def open_streams(self) -> int:
        return len(self._subs)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._conn is not None:
            await self._conn.aclose()

    # internals ------------------------------------------------------------------------------

    def _remove(self, sub: Subscription) -> None:
        sk = stream_key(sub.rid)
        subs = self._subs.get(sk, [])
        if sub in subs:
            subs.remove(sub)
        if not subs:
            self._subs.pop(sk, None)
            self._positions.pop(sk, None)

    async def _unblock(self) -> None:
        with contextlib.suppress(Exception):
            await get_async_redis().client_unblock(self._conn_id)

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="xread-relay")

    async def _connect(self) -> aioredis.Redis:
        # One connection (max_connections=1), so CLIENT ID names the one that runs XREAD.
        pool = aioredis.ConnectionPool.from_url(redis_url(), decode_responses=True,
                                                max_connections=1, client_name=RELAY_CLIENT_NAME)
        conn = aioredis.Redis(connection_pool=pool)
        self._conn_id = int(await conn.client_id())
        return conn

    async def _run(self) -> None:
        try:
            await self._serve()
        finally:  # the loop is ending (process shutdown): give the connection back at once
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    await self._conn.aclose()
                self._conn = None

    async def _serve(self) -> None:
        backoff = 0.05
        task = asyncio.current_task()
        while True:
            if task is not None and task.cancelling():
                # redis-py may swallow a cancel that lands mid-read; honour it here.
                raise asyncio.CancelledError()
            try:
                if self._conn is None:
                    self._conn = await self._connect()
                await self._read_once(self._conn)
                backoff = 0.05
            except asyncio.CancelledError:
                raise
            except Exception:
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError() from None
                log.exception("stream relay read failed; reconnecting")
                if self._conn is not None:
                    with contextlib.suppress(Exception):
                        await self._conn.aclose()
                self._conn = None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _read_once(self, conn: aioredis.Redis) -> None:
        if not self._positions:
            self._changed.clear()
            await self._changed.wait()
            return
        streams = dict(self._positions)
        self._blocked = True
        try:
            reply = await conn.xread(streams, count=READ_COUNT, block=READ_BLOCK_MS)
        finally:
            self._blocked = False
        for sk, entries in reply or []:
            subs = self._subs.get(sk)
            if not subs:
                continue
            for entry_id, fields in entries:
                event = StreamEvent(entry_id, fields)
                for sub in subs:
                    sub.offer(event)
            self._positions[sk] = entries[-1][0]


_readers: dict[int, tuple[asyncio.AbstractEventLoop, StreamReader]] = {}


def reader() -> StreamReader:
    """This event loop's reader (asyncio clients cannot cross loops, so one per loop)."""
    loop = asyncio.get_running_loop()
    found = _readers.get(id(loop))
    if found is None or found[0] is not loop:  # ids of closed loops get reused
        found = _readers[id(loop)] = (loop, StreamReader())
    return found[1]


def subscribe(rid: str, last_id: str = "0-0") -> AsyncIterator[StreamEvent]:
    return reader().subscribe(rid, last_id)


def open_subscription(rid: str, last_id: str = "0-0") -> Subscription:
    return reader().open(rid, last_id)
