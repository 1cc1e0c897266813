"""A lean HTTP/1.1 client for the upstream's streamed completions: pooled keep-alive
connections, responses parsed by ``httptools`` (C), body bytes handed over as they arrive.

Why not httpx: a profile of the worker behind a zero-delay upstream (``bench/ab.py --py-spy``)
put httpx's per-request machinery (its pool, httpcore's h11 state machine, anyio streams,
per-chunk decoding) at about a third of the worker's CPU, more than the relay itself. This
does the one thing the worker needs: POST a JSON body, read the status and the body as it
streams, keep the connection for the next request when the response ended cleanly, close it
otherwise (closing is how an abort reaches the upstream: vLLM and llama.cpp stop generating
when their client goes). Embeddings, and tests that inject an ``httpx`` transport, keep httpx.

A request that finds its pooled connection closed by the server before any byte of the
response arrived is sent again once on a new connection (the server never read it), as
urllib3 and httpx do; any other failure is the caller's (retryable, ``UpstreamEngine._error``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools

_PAUSE_AT = 1 << 20  # bytes buffered and not yet taken: stop reading the socket until taken


class UpstreamClosed(ConnectionError):
    """The connection ended before the response did."""


class _Conn(asyncio.Protocol):
    """One connection; one response at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self.status = 0
        self.headers_done = False
        self.complete = False
        self.keep_alive = False  # read when the message completes (the parser resets after)
        self.got_bytes = False  # any byte of the current response arrived
        self.error: Exception | None = None

    # asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = exc
            self.close()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            self.error = UpstreamClosed("the upstream closed the connection")
        self._wake()

    # httptools callbacks ---------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _PAUSE_AT and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()

    # the client's side -----------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def reset(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.status, self.headers_done, self.complete, self.got_bytes = 0, False, False, False
        self.keep_alive = False
        self.error = None
        self._chunks.clear()
        self._buffered = 0

    async def head(self) -> int:
        """Wait for the status line and headers; the status code."""
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            await self._wait()
        return self.status

    async def body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked encoding removed), until it ends."""
        while True:
            if self._chunks:
                data = b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                if self._paused and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                yield data
                continue
            if self.complete:
                return
            if self.error is not None:
                raise self.error
            await self._wait()

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


class Response:
    def __init__(self, conn: _Conn, status: int) -> None:
        self._conn = conn
        self.status_code = status

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        return self._conn.body()

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self._conn.body()])


class UpstreamHTTP:
    """Keep-alive connections to one upstream (scheme, host and port of ``base_url``)."""

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None,
                 max_connections: int = 64, connect_timeout_s: float = 5.0) -> None:
        url = urlsplit(base_url)
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self._ssl: ssl.SSLContext | None = (ssl.create_default_context()
                                            if url.scheme == "https" else None)
        host_header = self.host if url.port is None else f"{self.host}:{url.port}"
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = (f"Host: {host_header}\r\nContent-Type: application/json\r\n"
                      f"Accept: text/event-stream\r\n{extra}")
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(max_connections)
        self.connect_timeout_s = connect_timeout_s
        self.connections_made = 0  # diagnostics: a pool that works keeps this small

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(
                _Conn, self.host, self.port, ssl=self._ssl,
                server_hostname=self.host if self._ssl else None)
        self.connections_made += 1
        return conn

    def _pooled(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return None

    @contextlib.asynccontextmanager
    async def post(self, path: str, body: bytes) -> AsyncIterator[Response]:
        """POST ``body`` (JSON) to ``path``; the response, its body read while inside. The
        connection goes back to the pool only if the response was read to its end."""
        request = (f"POST {path} HTTP/1.1\r\n{self._head}Content-Length: {len(body)}\r\n\r\n"
                   ).encode() + body
        async with self._slots:
            conn, status = await self._send(request)
            try:
                yield Response(conn, status)
            finally:
                if conn.reusable():
                    conn.reset()
                    self._idle.append(conn)
                else:
                    conn.close()

    async def _send(self, request: bytes) -> tuple[_Conn, int]:
        conn = self._pooled()
        if conn is not None:
            conn.reset()
            assert conn.transport is not None
            conn.transport.write(request)
            try:
                return conn, await conn.head()
            except UpstreamClosed:
                conn.close()
                if conn.got_bytes:
                    raise
                # Closed by the server while idle (its keep-alive timeout): it never read
                # this request, so sending it again cannot run it twice.
            except BaseException:
                conn.close()
                raise
        conn = await self._connect()
        assert conn.transport is not None
        conn.transport.write(request)
        try:
            return conn, await conn.head()
        except BaseException:
            conn.close()
            raise

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


def headers_of(values: Any) -> dict[str, str]:
    """Header values without CR/LF (a key from the environment must not split the request)."""
    return {str(k): str(v).replace("\r", "").replace("\n", "") for k, v in dict(values).items()}
