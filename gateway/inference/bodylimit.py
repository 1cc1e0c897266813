"""Bounded request bodies for every HTTP route: at most ``MAX_REQUEST_BYTES``, within
``BODY_READ_TIMEOUT_S`` of the headers.

uvicorn bounds neither: it hands the app body chunks as they come, for as long as they come, and
Django's ASGI handler spools a whole body (any size) to a temporary file before the view runs.
So a client could fill the disk with one chunked upload, or hold a connection and a task forever
by trickling a body a byte a minute. ``read_bounded_body`` is the one reader: the inference
consumers call it, and ``BoundedBody`` wraps the Django application with it. Refusals are the
OpenAI-shaped 413 / 408, answered before anything is authenticated or charged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from django.conf import settings

from gateway.inference.errors import ApiError, payload_too_large

Receive = Callable[[], Awaitable[dict[str, Any]]]
# Mapping, as Django's ASGIHandler declares it, so that it is an ASGIApp here.
Send = Callable[[Mapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]


def body_timeout() -> ApiError:
    return ApiError(408, "The request body did not arrive in time.", code="request_timeout",
                    headers={"connection": "close"})


def declared_length(scope: dict[str, Any]) -> str | None:
    name: bytes
    value: bytes
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            return value.decode("latin-1").strip()
    return None


async def read_bounded_body(scope: dict[str, Any], receive: Receive) -> bytes | None:
    """The whole body, or None if the client left first; raises ApiError 413 or 408."""
    limit: int = settings.MAX_REQUEST_BYTES
    declared = declared_length(scope)
    if declared and (not declared.isdigit() or int(declared) > limit):
        raise payload_too_large(limit)
    # One deadline for the whole body, not per chunk: a byte every few seconds must not reset it.
    deadline = time.monotonic() + settings.BODY_READ_TIMEOUT_S
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise body_timeout() from None
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:  # also when there is no Content-Length (chunked) or it lied
            raise payload_too_large(limit)
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts)


async def send_api_error(send: Send, err: ApiError) -> None:
    body = err.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BoundedBody:
    """ASGI middleware: read the body with ``read_bounded_body``, then replay it to ``app``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await read_bounded_body(scope, receive)
        except ApiError as err:
            await send_api_error(send, err)
            return
        if body is None:
            return  # gone before it finished sending: nothing to answer
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()  # later calls wait for the disconnect, as before
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
