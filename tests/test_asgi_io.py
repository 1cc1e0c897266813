"""``bench/asgi_io.py``: the body reader and JSON answer shared by the stand-in upstreams
(``bench/zero_upstream.py``, run as a script, and ``tests/upstream_server.py``)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.asgi_io import read_body, send_json
from tests import procs


def _receiver(messages: list[dict[str, Any]]) -> Any:
    queue = iter(messages)

    async def receive() -> dict[str, Any]:
        return next(queue)

    return receive


def test_read_body_joins_every_message_and_stops_at_the_last() -> None:
    messages = [{"type": "http.request", "body": b'{"a":', "more_body": True},
                {"type": "http.request", "more_body": True},  # a message may carry no body
                {"type": "http.request", "body": b" 1}", "more_body": False},
                {"type": "http.disconnect"}]  # must stay unread: the stream watcher's
    receive = _receiver(messages)
    assert asyncio.run(read_body(receive)) == b'{"a": 1}'
    assert asyncio.run(receive()) == {"type": "http.disconnect"}


def test_send_json_answers_status_type_and_body() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(send_json(send, 404, {"error": "no"}))
    assert sent[0] == {"type": "http.response.start", "status": 404,
                       "headers": [(b"content-type", b"application/json")]}
    assert json.loads(sent[1]["body"]) == {"error": "no"}


@pytest.fixture
def zero_upstream(tmp_path: Path) -> Iterator[str]:
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    # As bench/ab.py starts it: a script, whose own folder is where `asgi_io` is found.
    server = procs.Server([sys.executable, str(procs.ROOT / "bench" / "zero_upstream.py"),
                           "--port", str(port)], url, "/health", tmp_path / "zero.log")
    yield url
    server.stop()


@pytest.mark.integration
def test_zero_upstream_reads_a_chunked_body(zero_upstream: str) -> None:
    def pieces() -> Iterator[bytes]:  # chunked transfer: uvicorn hands it over in parts
        yield b'{"model": "up", "prompt": "one two three",'
        yield b' "max_tokens": 5}'

    resp = httpx.post(zero_upstream + "/v1/completions", content=pieces(), timeout=10)
    assert resp.status_code == 200
    assert resp.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 5,
                                    "total_tokens": 8}
