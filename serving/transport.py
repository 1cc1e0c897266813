"""Token transport: worker -> one Redis stream per request -> the gateway holding the client.

Writer (worker): every engine step, the deltas of all requests that produced tokens go out in ONE
round trip, whose first command is one ``relay_step.lua`` call doing one ``XADD stream:{rid}``
per request, whose entry id carries the request's delivered count (``<tokens so far>-<entry
index>``: the janitor bills a lost request for what was delivered, read back from the last
entry), and on a request's first tokens its ``first_token_at`` stamp. One script, one command
per request per step, packed by hand: the worker packs and parses one reply per step, and the
gateway's blocked XREAD wakes once per step with all of it. A stream's
last entry is written by ``settle.lua``, in the step that settles the request, so "final event"
and "settled" are one.

Entry fields, short because there is one entry per request per step:

    t  text of the delta          n  token count of the delta
    f  finish reason (last entry) u  usage JSON (last entry)
    e  error code (last entry)    m  error message   r  retryable ("1"/"0")

Streams are capped (MAXLEN ~) and expire a short while after the end, so a client that
reconnects with ``Last-Event-ID`` can resume from any entry id until then.

Reader (gateway): ONE task per pool per process (per event loop) runs a multiplexed
``XREAD BLOCK ... STREAMS k1 k2 ...`` over every open request of that pool in the process and
feeds per-request asyncio queues. Per pool because a request's stream carries its pool's hash
tag (ADR 0018): under Redis Cluster one XREAD may only name keys of one slot, and the pool's
streams all share one. A new subscription interrupts the blocked read with
``CLIENT UNBLOCK`` so its stream joins the next read at once. One reader per process, not one
blocking connection per stream, is what relays tens of thousands of tokens/s
(``bench/sse_throughput.py``; the per-step writer's design: docs/adr/0007).

Cancel: the gateway publishes the request id on ``cancel:{pool}``; every worker of the pool is
subscribed and the one running it calls ``engine.abort`` (``serving.submission.cancel_request``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import redis
import redis.asyncio as aioredis

from infra.loop_local import LoopLocal
from infra.redis_conn import (
    async_pool_for,
    get_async_redis,
    get_redis,
    key,
    new_async_pool_for,
    on_master,
    refresh_slots,
)
from serving.keys import req_key, stream_key, wake_key  # noqa: F401 (re-exported)
from serving.lua import script
from serving.settlement import STREAM_MAXLEN

log = logging.getLogger(__name__)

# A running request's stream expires this long after its first tokens unless settle.lua
# shortens it to the after-end window first; it bounds what a lost stream can leak. Longer than
# any total deadline (the janitor settles a request by its deadline + grace).
RUNNING_STREAM_TTL_S = 2 * 3600
READ_BLOCK_MS = 1000  # a blocked read is interrupted by new subscriptions; this is a backstop
# A new subscription interrupts a blocked read only if the read is still blocked this long after
# it: under load the read returns by itself within a step (any stream's entry ends it), and the
# CLIENT UNBLOCK plus the re-sent read were two of the gateway's round trips per request. A
# stream's first entry cannot come sooner anyway (dispatch, claim, the engine's first token),
# and nothing is lost meanwhile: the new stream is read from its start.
UNBLOCK_AFTER_S = 0.002
READ_COUNT = 512  # entries per stream per read
RELAY_CLIENT_NAME = "igw-relay"  # CLIENT LIST shows one such connection per gateway loop
# Redis unreachable this long: every open stream of the process ends with a retryable error
# instead of waiting for its deadline (a client retries sooner than a total deadline).
RELAY_OUTAGE_FAIL_S = 3.0
RECONNECT_MAX_S = 0.5  # one connection attempt per process at most this often while down
# After the master moved (a Sentinel failover), how long the relay keeps looking, every
# LOST_RECHECK_EVERY_S, for requests the new master does not know: admitted on the old one
# just before the move, they will never get another entry.
LOST_RECHECK_S = 3.0
LOST_RECHECK_EVERY_S = 0.5
LOST_EVENT_ID = "18446744073709551615-0"  # after any real entry id, so every consumer takes it


def cancel_channel(pool: str) -> str:
    # A channel, not a key: Redis Cluster delivers a PUBLISH to the subscribers on every node.
    return key("cancel", pool)


# -- writer (worker) --------------------------------------------------------------------------


@dataclass
class StepBatch:
    """Everything one engine step produced, written in one round trip.

    Order on the wire is the order of calls, so a request's last tokens always precede its
    settle (and the final entry that settle writes). The relay command is packed here rather
    than by redis-py: with 1,000 running streams it has 5,000 arguments a step, and redis-py's
    per-argument encoding was a third of the worker's time (bench/sse_throughput.py).

    Every command of a batch is safe to send twice, so a batch whose connection fails is sent
    again once, on a fresh connection, from the first command that got no reply: a request's
    entry has the same id the second time, which Redis refuses (relay_step.lua R1), and settle
    applies once per request.
    """

    pool: str = ""  # every request of a batch is of this pool (one worker, one pool)
    # Per request: its texts, their token count, the tokens relayed before this batch and the
    # index of its entry (1: its first): the entry's id (relay_step.lua D1, R1).
    tokens: dict[str, tuple[list[str], int, int, int]] = field(default_factory=dict)
    first: set[str] = field(default_factory=set)
    settles: list[tuple[str, list[str], list[Any]]] = field(default_factory=list)
    # release.lua calls of requests settled in an earlier batch (keys, args): the tenant's
    # give-back rides in this round trip instead of one of its own (issue 30). Not under
    # Redis Cluster: their keys are on the tenant's slot, not the pool's.
    releases: list[tuple[list[str], list[Any]]] = field(default_factory=list)

    def add(self, rid: str, text: str, n: int, *, before: int, first: bool = False,
            index: int | None = None) -> None:
        """``before``: the tokens of ``rid`` handed to earlier batches (its delivered count
        once they are written); ``index``: how many batches held ``rid`` before this one, + 1
        (default ``before + 1``, right only while every entry has a token)."""
        texts, count, before, index = self.tokens.get(
            rid, ([], 0, before, before + 1 if index is None else index))
        texts.append(text)
        self.tokens[rid] = (texts, count + n, before, index)
        if first:
            self.first.add(rid)

    def settle(self, rid: str, keys: list[str], args: list[Any]) -> None:
        self.settles.append((rid, keys, args))

    def release(self, keys: list[str], args: list[Any]) -> None:
        self.releases.append((keys, args))

    def __bool__(self) -> bool:
        return bool(self.tokens or self.settles or self.releases)

    def _relay_command(self, stream_ttl: int) -> bytes:
        """EVAL relay_step.lua over every delta of the step, as one RESP command."""
        n = len(self.tokens)
        stream_prefix, req_prefix = stream_key(self.pool, ""), req_key(self.pool, "")
        first = self.first
        keys: list[bytes] = []
        args: list[bytes] = [_bulk(str(STREAM_MAXLEN)), _bulk(str(stream_ttl))]
        for rid, (texts, count, before, index) in self.tokens.items():
            keys += (_bulk(stream_prefix + rid), _bulk(req_prefix + rid))
            args += (_bulk("".join(texts)), _bulk(str(count)),
                     _ONE if rid in first else _ZERO, _bulk(str(before + count)),
                     _bulk(str(index)))
        head = b"*%d\r\n$4\r\nEVAL\r\n%s%s" % (
            3 + len(keys) + len(args), _relay_source(), _bulk(str(2 * n)))
        return b"".join((head, *keys, *args))

    async def flush(self, client: aioredis.Redis, stream_ttl: int) -> list[Any]:
        """Write the batch; returns the settle replies in the order they were added.

        A settle that Redis refused comes back as its exception (the others still count). A
        lost connection is retried once on a fresh one; a second loss, or a failed relay
        command, raises, since tokens may be missing.
        """
        if not self:
            return []
        # Every key of the batch is on the pool's slot: under Redis Cluster, its node's pool.
        pool = await async_pool_for(client, stream_key(self.pool, ""))
        commands: list[list[bytes]] = []
        replies: list[Any] = []
        for attempt in (1, 2):
            conn = await pool.get_connection()  # type: ignore[no-untyped-call]  # unannotated
            try:
                if not commands:
                    commands = self._pack(conn, stream_ttl)
                await conn.send_packed_command(
                    [chunk for command in commands[len(replies):] for chunk in command])
                while len(replies) < len(commands):
                    try:
                        replies.append(await conn.read_response())
                    except redis.ResponseError as exc:  # read whole: the connection stays in step
                        replies.append(exc)
                break
            except redis.ConnectionError:
                if attempt == 2:
                    raise
                # A connection the server closed after it was checked out (a restart, a
                # failover): send what got no reply again, on a fresh connection.
                log.warning("a step batch of pool %s lost its connection; sending it again",
                            self.pool)
            finally:
                await pool.release(conn)
        moved = next((r for r in replies if _moved(r)), None)
        if moved is not None:
            # The pool's slot moved (a reshard): learn its new owner, and fail the batch as a
            # lost connection would, so the worker retries its settles there (safe: once).
            await refresh_slots()
            raise redis.ConnectionError(f"the pool's slot moved: {moved}")
        if self.tokens and isinstance(replies[0], Exception):
            raise replies[0]
        start = 1 if self.tokens else 0
        for failed in replies[start + len(self.settles):]:
            if isinstance(failed, Exception):  # its token's expiry releases it (admit.lua A5)
                log.error("a release in a step batch of pool %s failed: %s", self.pool, failed)
        return replies[start:start + len(self.settles)]

    def _pack(self, conn: Any, stream_ttl: int) -> list[list[bytes]]:
        """Each command of the batch as the chunks to send: the relay, every settle, then
        every release (each safe to send twice: once by its request's release token)."""
        commands = [[self._relay_command(stream_ttl)]] if self.tokens else []
        settle = _code_only(script("settle").source)
        for _rid, keys, args in self.settles:
            # EVAL with the body, as in a pipeline: NOSCRIPT could not be retried in order.
            commands.append(conn.pack_command("EVAL", settle, len(keys), *keys, *args))
        release = _code_only(script("release").source) if self.releases else ""
        for keys, args in self.releases:
            commands.append(conn.pack_command("EVAL", release, len(keys), *keys, *args))
        return commands


_ONE, _ZERO = b"$1\r\n1\r\n", b"$1\r\n0\r\n"


def _moved(reply: object) -> bool:
    """A Redis Cluster redirect: the key's slot is (being) served by another node."""
    # redis-py parses the reply into MovedError / AskError (MovedError is an AskError).
    return isinstance(reply, redis.exceptions.AskError)


@cache
def _relay_source() -> bytes:
    return _bulk(_code_only(script("relay_step").source))


@cache
def _code_only(source: str) -> str:
    """A script as sent with every EVAL: without its comment lines and blank lines, which are
    most of its bytes (Redis hashes and parses the body each time: settle.lua's 5.3 KB become
    3.2, relay_step.lua's 1.9 become 0.8). Whole lines only: a ``--`` after code could be
    inside a string."""
    return "\n".join(line for line in source.splitlines()
                     if line.strip() and not line.lstrip().startswith("--"))


def error_event(code: str, message: str, *, retryable: bool,
                param: str | None = None) -> dict[str, str]:
    event = {"e": code, "m": message, "r": "1" if retryable else "0"}
    if param:  # the request parameter a refusal names (absent from every other error)
        event["p"] = param
    return event


def finish_event(finish_reason: str, usage: Mapping[str, int], text: str = "",
                 n: int = 0) -> dict[str, str | int]:
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


@dataclass(frozen=True, slots=True)
class StreamEvent:
    id: str
    fields: dict[str, str]

    @property
    def terminal(self) -> bool:
        return "f" in self.fields or "e" in self.fields


def _id_tuple(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def delivered(client: redis.Redis, stream: str) -> int:
    """The tokens written to a request's stream (its key) so far, before its final entry: the
    last token entry's id holds the count (relay_step.lua D1; settle.lua reads it so too)."""
    last = client.xrevrange(stream, count=1)
    if not last:
        return 0
    entry_id = last[0][0]
    return _id_tuple(entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id))[0]


def _bulk(value: str) -> bytes:
    """One RESP bulk string (a command argument)."""
    raw = value.encode()
    return b"$%d\r\n%s\r\n" % (len(raw), raw)


class Subscription:
    """One consumer of one request's stream, fed by the process's reader.

    Hot path: one entry per request per engine step, so a wait costs one future and no task;
    the deadline timer is armed once per deadline, not once per wait (``asyncio.wait_for`` made
    a task and a timer for every token).
    """

    def __init__(self, owner: StreamReader, rid: str, last_id: str) -> None:
        self._owner = owner
        self.pool = owner.pool
        self.rid = rid
        self.last_id = last_id
        self._last = _id_tuple(last_id)
        self._events: deque[StreamEvent] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_deadline: float | None = None
        self.done = False  # the terminal entry has been queued

    def offer(self, event: StreamEvent, position: tuple[int, int]) -> None:
        if self.done or position <= self._last:
            return  # an entry this consumer already has (several consumers share one read)
        self._last = position
        self.last_id = event.id
        self._events.append(event)
        self.done = event.terminal
        self._wake()

    @property
    def ready(self) -> int:
        """Entries queued and not yet taken: the caller can batch them into one write."""
        return len(self._events)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_timer(self) -> None:
        self._timer, self._timer_deadline = None, None
        self._wake()

    async def next(self, timeout: float | None = None) -> StreamEvent | None:
        """The next entry, or None when ``timeout`` seconds pass first."""
        if self._events:
            return self._events.popleft()
        return await self.next_before(None if timeout is None else time.monotonic() + timeout)

    async def next_before(self, deadline: float | None) -> StreamEvent | None:
        """The next entry, or None once ``time.monotonic()`` reaches ``deadline`` first."""
        while not self._events:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if self._timer_deadline != deadline:
                    self._arm(deadline, left)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._events.popleft()

    def _arm(self, deadline: float, left: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(left, self._on_timer)
        self._timer_deadline = deadline

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._owner._remove(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamReader:
    """The one multiplexed XREAD of an event loop, serving every subscription in it.

    Cost per read is what limits a process relaying ~1,000 streams: the command names every
    open stream with its position. So the command is kept pre-encoded (one RESP chunk per key
    and per position, re-encoded only for the streams that moved), it goes out and comes back
    on a bare connection (hiredis decodes; no redis-py reply callbacks building dicts per
    entry), and a burst of new subscriptions interrupts a blocked read once, not once each.
    """

    def __init__(self, pool: str = "") -> None:
        self.pool = pool  # every stream this reader reads is of this pool (one slot)
        self._subs: dict[str, list[Subscription]] = {}  # stream key -> subscriptions
        self._positions: dict[str, str] = {}  # stream key -> id the next read starts after
        # Pre-encoded command parts; both dicts always hold the same keys in the same order.
        self._key_chunks: dict[str, bytes] = {}
        self._id_chunks: dict[str, bytes] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._conn: Any = None  # a redis.asyncio Connection, used by this reader only
        self._conn_pool: Any = None
        self._unblocker: Any = None  # a client on _conn_pool (made once: its setup is not free)
        self._conn_id: int | None = None
        self._blocked = False
        self._unblocking = False  # a CLIENT UNBLOCK for the current read is on its way
        self._read_seq = 0  # which read is in flight (a late unblock timer checks it)
        self.unblocks = 0  # CLIENT UNBLOCKs sent (diagnostics for the benchmarks and tests)
        self._down_since: float | None = None  # loop time of the first failed read
        self._recheck_until = 0.0  # loop time: look for lost requests until then (a move)
        self._rechecked_at = 0.0
        self.reads = 0  # XREAD round trips (diagnostics for the benchmarks)
        self.entries = 0

    # public ---------------------------------------------------------------------------------

    def open(self, rid: str, last_id: str = "0-0") -> Subscription:
        """Start receiving stream:{rid} entries after ``last_id``; close() when done."""
        sub = Subscription(self, rid, last_id)
        sk = stream_key(self.pool, rid)
        self._subs.setdefault(sk, []).append(sub)
        current = self._positions.get(sk)
        if current is None or _id_tuple(last_id) < _id_tuple(current):
            self._set_position(sk, last_id)
        self._ensure_running()
        self._changed.set()
        if self._blocked and self._conn_id is not None and not self._unblocking:
            # Interrupt the blocked XREAD so this stream is read soon, not after READ_BLOCK_MS,
            # unless the read returns by itself first (UNBLOCK_AFTER_S); every stream opened
            # before the next read is sent joins it.
            self._unblocking = True
            asyncio.get_running_loop().call_later(UNBLOCK_AFTER_S, self._unblock_late,
                                                  self._read_seq)
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
        await self._drop_conn()

    # internals ------------------------------------------------------------------------------

    def _set_position(self, sk: str, entry_id: str) -> None:
        self._positions[sk] = entry_id
        self._id_chunks[sk] = _bulk(entry_id)
        if sk not in self._key_chunks:
            self._key_chunks[sk] = _bulk(sk)

    def _remove(self, sub: Subscription) -> None:
        sk = stream_key(self.pool, sub.rid)
        subs = self._subs.get(sk, [])
        if sub in subs:
            subs.remove(sub)
        if not subs:
            self._subs.pop(sk, None)
            self._positions.pop(sk, None)
            self._key_chunks.pop(sk, None)
            self._id_chunks.pop(sk, None)

    def _unblock_late(self, seq: int) -> None:
        if self._blocked and self._read_seq == seq:  # still the same read, still blocked
            self.unblocks += 1
            asyncio.get_running_loop().create_task(self._unblock())

    async def _unblock(self) -> None:
        if self._conn_id is None or self._conn_pool is None:
            return
        with contextlib.suppress(Exception):
            # Through the reader's own pool: the same Redis (cluster node) as the blocked read.
            if self._unblocker is None or self._unblocker.connection_pool is not self._conn_pool:
                self._unblocker = aioredis.Redis(connection_pool=self._conn_pool)
            await self._unblocker.client_unblock(self._conn_id)

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="xread-relay")

    async def _connect(self) -> Any:
        pool = await new_async_pool_for(stream_key(self.pool, ""), decode_responses=True,
                                         client_name=RELAY_CLIENT_NAME)
        self._conn_pool = pool  # a Sentinel pool's connection refers to it weakly
        conn = pool.connection_class(**pool.connection_kwargs)
        await conn.connect()  # type: ignore[no-untyped-call]  # unannotated in redis-py
        await conn.send_command("CLIENT", "ID")
        self._conn_id = int(await conn.read_response())
        return conn

    async def _drop_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.disconnect()

    async def _run(self) -> None:
        try:
            await self._serve()
        finally:  # the loop is ending (process shutdown): give the connection back at once
            await self._drop_conn()

    async def _serve(self) -> None:
        backoff = 0.05
        task = asyncio.current_task()
        while True:
            if task is not None and task.cancelling():
                # redis-py may swallow a cancel that lands mid-read; honour it here.
                raise asyncio.CancelledError()
            try:
                if self._conn is not None and self._conn_pool is not None and not (
                        await on_master(self._conn_pool, self._conn)):
                    await self._drop_conn()  # a failover: read from the new master (ADR 0016)
                    self._recheck_until = asyncio.get_running_loop().time() + LOST_RECHECK_S
                if self._conn is None:
                    self._conn = await self._connect()
                    if self._down_since is not None:
                        await self._fail_lost(self._conn)
                await self._recheck_lost(self._conn)
                await self._read_once(self._conn)
                backoff = 0.05
                self._down_since = None
            except asyncio.CancelledError:
                raise
            except Exception:
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError() from None
                log.exception("stream relay read failed; reconnecting")
                now = asyncio.get_running_loop().time()
                self._down_since = self._down_since or now
                if now - self._down_since >= RELAY_OUTAGE_FAIL_S:
                    self._fail(list(self._subs), "service_unavailable",
                               "The service lost its state store; please retry.")
                await self._drop_conn()
                await asyncio.sleep(backoff)
                # At most RECONNECT_MAX_S between tries: a Redis back within the outage budget
                # (RELAY_OUTAGE_FAIL_S) is found in time, not after one long sleep past it.
                backoff = min(backoff * 2, RECONNECT_MAX_S)

    def _fail(self, stream_keys: list[str], code: str, message: str) -> None:
        """End these streams' consumers with a retryable error (their stream is gone)."""
        event = StreamEvent(LOST_EVENT_ID, {"e": code, "m": message, "r": "1"})
        position = _id_tuple(LOST_EVENT_ID)
        for sk in stream_keys:
            for sub in list(self._subs.get(sk, [])):
                sub.offer(event, position)

    async def _recheck_lost(self, conn: Any) -> None:
        now = asyncio.get_running_loop().time()
        if now < self._recheck_until and now - self._rechecked_at >= LOST_RECHECK_EVERY_S:
            self._rechecked_at = now
            await self._fail_lost(conn)

    async def _fail_lost(self, conn: Any) -> None:
        """After a reconnect: a request whose state is gone (Redis restarted empty) will never
        get another entry, so its consumers end now rather than at their deadline."""
        stream_keys = list(self._subs)
        if not stream_keys:
            return
        # One write, then the replies: a round trip for all, not one per open stream (every
        # request hash is on the pool's slot, so one connection holds them all).
        await conn.send_packed_command(conn.pack_commands(
            [("EXISTS", req_key(self.pool, self._subs[sk][0].rid)) for sk in stream_keys]),
            check_health=False)
        found = [int(await conn.read_response()) for _ in stream_keys]
        lost = [sk for sk, exists in zip(stream_keys, found, strict=True) if not exists]
        self._fail(lost, "state_lost", "The service restarted and lost this request; retry.")

    def _command(self) -> bytes:
        n = len(self._key_chunks)
        return b"".join((
            b"*%d\r\n$5\r\nXREAD\r\n$5\r\nCOUNT\r\n%s$5\r\nBLOCK\r\n%s$7\r\nSTREAMS\r\n"
            % (2 * n + 6, _bulk(str(READ_COUNT)), _bulk(str(READ_BLOCK_MS))),
            *self._key_chunks.values(), *self._id_chunks.values()))

    async def _read_once(self, conn: Any) -> None:
        if not self._positions:
            self._changed.clear()
            await self._changed.wait()
            return
        command = self._command()
        self._blocked = True
        self._read_seq += 1
        try:
            await conn.send_packed_command(command, check_health=False)
            reply = await conn.read_response()
        except redis.exceptions.AskError:
            # The pool's slot moved (a reshard; Redis unblocks the read with a redirect): learn
            # its new owner, so the reconnect that follows goes there.
            await refresh_slots()
            raise
        finally:
            self._blocked = False
            self._unblocking = False
        self.reads += 1
        if isinstance(reply, Exception):
            raise reply
        if not reply:
            return
        # RESP3 (redis-py's default protocol since 8) answers a map; RESP2 a list of pairs.
        for sk, entries in reply.items() if isinstance(reply, dict) else reply:
            self._dispatch(sk, entries)

    def _dispatch(self, sk: str, entries: list[Any]) -> None:
        subs = self._subs.get(sk)
        if not subs:
            return
        self.entries += len(entries)
        for entry_id, flat in entries:
            pairs = iter(flat or ())
            fields = dict(zip(pairs, pairs))  # noqa: B905 - [f1, v1, f2, v2, ...]
            event = StreamEvent(entry_id, fields)
            position = _id_tuple(entry_id)
            for sub in subs:
                sub.offer(event, position)
        self._set_position(sk, entries[-1][0])


_readers: LoopLocal[dict[str, StreamReader]] = LoopLocal(dict)


def reader(pool: str) -> StreamReader:
    """This event loop's reader of ``pool``'s streams (asyncio clients cannot cross loops, so
    one per loop; one per pool, since one XREAD reads one slot under Redis Cluster)."""
    readers = _readers.get()
    found = readers.get(pool)
    if found is None:
        found = readers[pool] = StreamReader(pool)
    return found


def subscribe(pool: str, rid: str, last_id: str = "0-0") -> AsyncIterator[StreamEvent]:
    return reader(pool).subscribe(rid, last_id)


def open_subscription(pool: str, rid: str, last_id: str = "0-0") -> Subscription:
    return reader(pool).open(rid, last_id)
