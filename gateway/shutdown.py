"""This gateway process is shutting down: what open responses wait on to end themselves.

uvicorn's graceful shutdown stops accepting connections and then waits for the open ones to
finish, up to ``--timeout-graceful-shutdown``, before it cancels them without a word. A stream
can stay open for minutes, so the inference consumers end theirs as soon as shutdown begins:
a retryable error event (or a 503 before the first byte) and the end of the response, and the
request is cancelled so the worker frees its slot and settles it. uvicorn tells each connection
through its protocol's ``shutdown()``; ``gateway.httpproto`` calls ``begin()`` from there.

Everything here runs on the server's event loop thread.
"""

from __future__ import annotations

import asyncio

_began = False
_waiters: set[asyncio.Future[None]] = set()


def begin() -> None:
    """Wake every waiter, now and later (idempotent)."""
    global _began
    _began = True
    for fut in list(_waiters):
        if not fut.done():
            fut.set_result(None)


def began() -> bool:
    return _began


async def wait() -> None:
    """Return once shutdown has begun."""
    if _began:
        return
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    _waiters.add(fut)
    try:
        await fut
    finally:
        _waiters.discard(fut)


def reset() -> None:
    """For tests that run a consumer again in the same process."""
    global _began
    _began = False
