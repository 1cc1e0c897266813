"""The two ASGI chores every stand-in upstream repeats: read a request body, answer JSON.

Kept free of the project's own imports so that ``bench/zero_upstream.py`` stays the cheapest
upstream there can be (it runs as a script, beside this file); ``tests/upstream_server.py``
imports it as ``bench.asgi_io`` (tests may lean on bench, never the other way round).
"""

from __future__ import annotations

import json
from typing import Any

Send = Any
Receive = Any


async def read_body(receive: Receive) -> bytes:
    """The whole body, however many ``http.request`` messages the server split it into."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def send_json(send: Send, status: int, payload: Any) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})
