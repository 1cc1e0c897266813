"""The lean upstream HTTP client (workers.engine.upstream_http) against an in-process server.

The server is a raw asyncio one speaking HTTP/1.1 the way uvicorn does (chunked streaming,
keep-alive), so each test can decide how a response ends: cleanly (the connection is reused),
cut off (an error, never a silent short body), or on a connection the server closed while idle
(sent again, once, on a new one). No process is started.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from workers.engine.upstream_http import UpstreamClosed, UpstreamHTTP

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, dict[str, Any]],
                   Awaitable[bool]]


async def _request(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return {"line": lines[0], "headers": headers, "body": body}


class Server:
    """Answers each request with ``handler``; counts connections and requests."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[dict[str, Any]] = []
        self.closed_by_client = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1/completions"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    req = await _request(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed_by_client.set()
                    return
                assert req is not None
                self.requests.append(req)
                if not await self.handler(reader, writer, req):
                    writer.close()
                    return
        finally:
            writer.close()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def sse_ok(_r: asyncio.StreamReader, w: asyncio.StreamWriter, req: dict[str, Any]) -> bool:
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
    for i in range(3):
        w.write(chunk(b"data: {\"i\": %d}\n\n" % i))
        await w.drain()
    w.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await w.drain()
    return True  # keep the connection


async def read_all(client: UpstreamHTTP, body: dict[str, Any]) -> tuple[int, bytes]:
    async with client.post("/v1/completions", json.dumps(body).encode()) as resp:
        return resp.status_code, b"".join([c async for c in resp.aiter_bytes()])


def test_a_streamed_response_arrives_whole_and_its_connection_is_reused() -> None:
    async def main() -> None:
        server = Server(sse_ok)
        async with server as url:
            client = UpstreamHTTP(url, headers={"Authorization": "Bearer k"})
            for n in range(3):
                status, body = await read_all(client, {"n": n})
                assert status == 200
                assert body == (b'data: {"i": 0}\n\ndata: {"i": 1}\n\ndata: {"i": 2}\n\n'
                                b"data: [DONE]\n\n")
            await client.aclose()
        assert server.connections == 1 and client.connections_made == 1
        req = server.requests[2]
        assert req["line"] == "POST /v1/completions HTTP/1.1"
        assert json.loads(req["body"]) == {"n": 2}
        assert req["headers"]["authorization"] == "Bearer k"
        assert req["headers"]["host"].startswith("127.0.0.1:")

    asyncio.run(main())


def test_an_error_status_and_its_body_are_read_with_content_length() -> None:
    async def refuse(_r: Any, w: asyncio.StreamWriter, _req: Any) -> bool:
        body = b'{"error": {"message": "too long"}}'
        w.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await w.drain()
        return True

    async def main() -> None:
        async with Server(refuse) as url:
            client = UpstreamHTTP(url)
            async with client.post("/v1/completions", b"{}") as resp:
                assert resp.status_code == 400
                assert json.loads(await resp.aread())["error"]["message"] == "too long"
            await client.aclose()

    asyncio.run(main())


def test_leaving_a_response_early_closes_its_connection_which_the_upstream_sees() -> None:
    """An abort: the worker stops reading; the upstream must see its client go (so it stops
    generating), and the half-read connection must never serve another request."""
    async def endless(_r: Any, w: asyncio.StreamWriter, _req: Any) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:
                w.write(chunk(b"data: {}\n\n"))
                await w.drain()
                await asyncio.sleep(0.005)
        except ConnectionError:
            return False

    async def main() -> None:
        server = Server(endless)
        async with server as url:
            client = UpstreamHTTP(url)
            async with client.post("/v1/completions", b"{}") as resp:
                async for _ in resp.aiter_bytes():
                    break
            await asyncio.wait_for(_eof_seen(server), 5)
            async with client.post("/v1/completions", b"{}") as resp:
                async for _ in resp.aiter_bytes():
                    break
        assert client.connections_made == 2

    async def _eof_seen(server: Server) -> None:
        while server.connections < 1 or not server.requests:
            await asyncio.sleep(0.01)
        # The handler's write fails once the client closed: it returns and closes.
        await asyncio.sleep(0.05)

    asyncio.run(main())


def test_a_response_cut_off_midway_raises_rather_than_ending_short() -> None:
    async def cut(_r: Any, w: asyncio.StreamWriter, _req: Any) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"data: {}\n\n"))
        await w.drain()
        return False  # close without the last chunk

    async def main() -> None:
        async with Server(cut) as url:
            client = UpstreamHTTP(url)
            with pytest.raises(UpstreamClosed):
                await read_all(client, {})
            assert not client._idle  # never pooled

    asyncio.run(main())


@pytest.mark.parametrize("pause", [0.0, 0.05])
def test_a_pooled_connection_the_server_closed_while_idle_is_replaced_once(pause: float) -> None:
    """The server's keep-alive timeout closed the connection between two requests: the second
    request goes on a new connection and succeeds; the server saw it once. With no pause the
    close arrives after the request was written to the old connection (sent again); with one,
    before (the pool drops the connection)."""
    async def once(r: Any, w: asyncio.StreamWriter, req: Any) -> bool:
        await sse_ok(r, w, req)
        return False  # then close (as an idle timeout would)

    async def main() -> None:
        server = Server(once)
        async with server as url:
            client = UpstreamHTTP(url)
            assert (await read_all(client, {"n": 1}))[0] == 200
            await asyncio.sleep(pause)
            assert (await read_all(client, {"n": 2}))[0] == 200
        assert [json.loads(r["body"])["n"] for r in server.requests] == [1, 2]
        assert client.connections_made == 2

    asyncio.run(main())


def test_an_unreachable_upstream_is_a_connection_error() -> None:
    async def main() -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        client = UpstreamHTTP(f"http://127.0.0.1:{port}/v1/completions")
        with pytest.raises(OSError):
            await read_all(client, {})

    asyncio.run(main())


def test_an_upstream_behind_a_configured_proxy_keeps_httpx(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The lean client does not speak to proxies: where the environment names one for the
    upstream (and NO_PROXY does not exempt it), the engine keeps httpx, which honours it."""
    from workers.engine.upstream import proxied

    for name in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
                 "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert not proxied("http://10.0.0.5:8000/v1/completions")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.internal:3128")
    assert proxied("http://10.0.0.5:8000/v1/completions")
    assert not proxied("https://10.0.0.5:8000/v1/completions")
    monkeypatch.setenv("NO_PROXY", "10.0.0.5")
    assert not proxied("http://10.0.0.5:8000/v1/completions")
