"""One object per running asyncio event loop, for things bound to a loop (asyncio Redis clients,
the stream reader, the liveness registry): they cannot be shared across loops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class LoopLocal(Generic[T]):
    """``get()`` returns this loop's instance, made by ``factory`` on first use in the loop.

    Keyed by the loop's id but checked against the loop itself: a new loop can reuse a closed
    loop's id and must not be handed that loop's object (its connections are dead).
    """

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._by_loop: dict[int, tuple[asyncio.AbstractEventLoop, T]] = {}

    def get(self) -> T:
        loop = asyncio.get_running_loop()
        found = self._by_loop.get(id(loop))
        if found is None or found[0] is not loop:
            found = self._by_loop[id(loop)] = (loop, self._factory())
        return found[1]

    def clear(self) -> None:
        """Forget every loop's instance (tests that start fresh loops)."""
        self._by_loop.clear()
