"""ORM calls made from the event loop run in a worker thread, with Django's connection care.

Django checks a thread's database connection around each HTTP request (``close_old_connections``:
close it if an error left it unusable or it outlived ``CONN_MAX_AGE``). Code on the event loop
that hands ORM work to a thread pool gets no request around it, so a connection broken by a
database outage would stay broken in that pool thread, and every later call there would fail
although the database is back. ``in_thread`` wraps such a function so the check runs before and
after each call (Channels' ``database_sync_to_async``), in a thread of the shared pool rather
than the one thread-sensitive thread (``thread_sensitive=False``): these reads must not queue
behind the authentication path, which uses that thread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar, cast

from channels.db import database_sync_to_async

P = ParamSpec("P")
R = TypeVar("R")


def in_thread(fn: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """``fn`` as a coroutine function that runs in a pool thread with a checked connection."""
    return cast(Callable[P, Awaitable[R]], database_sync_to_async(fn, thread_sensitive=False))
