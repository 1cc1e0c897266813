"""This gateway process is shutting down: open responses end themselves instead of waiting.

uvicorn's graceful shutdown stops accepting connections and then waits for the open ones to
finish, up to ``--timeout-graceful-shutdown``, before it cancels them without a word. A stream
can stay open for minutes, so the inference consumers end theirs as soon as shutdown begins:
a retryable error event (or a 503 before the first byte) and the end of the response, and the
request is cancelled so the worker frees its slot and settles it. uvicorn tells each connection
through its protocol's ``shutdown()``; ``gateway.httpproto`` calls ``begin()`` from there.

A response subscribes a hook for its lifetime (a set insert: no task per request on the hot
path); ``begin()`` calls every hook once. Everything here runs on the server's event loop.
"""

from __future__ import annotations

from collections.abc import Callable

Hook = Callable[[], object]

_began = False
_hooks: set[Hook] = set()


def begin() -> None:
    """Call every subscribed hook, once (idempotent)."""
    global _began
    if _began:
        return
    _began = True
    hooks = list(_hooks)
    _hooks.clear()
    for hook in hooks:
        hook()


def subscribe(hook: Hook) -> None:
    """``hook()`` when shutdown begins (at once if it has)."""
    if _began:
        hook()
    else:
        _hooks.add(hook)


def unsubscribe(hook: Hook) -> None:
    _hooks.discard(hook)

