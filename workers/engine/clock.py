"""Clocks for the engine: real time for serving, virtual time for tests and simulations.

The engine only ever asks a clock for ``now()`` and ``await clock.sleep(seconds)``.

``VirtualClock`` runs its own asyncio event loop whose time is virtual: when every task is
blocked on a timer (nothing is ready to run and no I/O is pending), the loop jumps straight to
the next timer instead of waiting for it. So an hour of engine steps passes as fast as the CPU
can compute them, yet the order of events is exactly what it would be in real time. Because the
loop itself is virtual, ``asyncio.sleep`` and ``asyncio.wait_for`` in any code it runs (load
generators, deadlines) are virtual too.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    """Wall-clock time (monotonic), for serving."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class VirtualDeadlock(RuntimeError):
    """Every task waits, no timer is pending and no I/O arrived: the simulation is stuck."""


class _VirtualSelector(selectors.DefaultSelector):
    """A selector that advances virtual time instead of blocking on a timeout."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        # Real I/O (a thread's call_soon_threadsafe, a socket) still wins: look without waiting.
        events = super().select(0)
        if events or (timeout is not None and timeout <= 0):
            return events
        if timeout is None:
            # No timer at all: only real I/O (a thread, a socket) can wake the loop. If none
            # comes, every task waits on something no timer will ever set: a deadlock, which
            # in a simulation means a bug (a request never admitted, a future never set).
            events = super().select(self._clock.idle_timeout)
            if not events and self._clock.idle_timeout is not None:
                raise VirtualDeadlock(
                    f"virtual clock: every task is blocked with no timer pending "
                    f"(waited {self._clock.idle_timeout}s of real time for I/O)"
                )
            return events
        self._clock._advance(timeout)
        return []


class _VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(_VirtualSelector(clock))
        self._virtual_clock = clock

    def time(self) -> float:
        return self._virtual_clock._now


class VirtualClock:
    """Virtual time that jumps forward whenever every task is waiting on it.

    Use ``clock.run(main())`` (or ``run_virtual``) to run a coroutine on the virtual loop.
    """

    def __init__(self, start: float = 0.0, idle_timeout: float | None = 10.0) -> None:
        self._now = start
        # Real seconds to wait for I/O when no timer is pending before declaring a deadlock;
        # None waits forever (a loop that also serves real sockets).
        self.idle_timeout = idle_timeout

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def _advance(self, seconds: float) -> None:
        self._now += seconds

    def new_loop(self) -> asyncio.AbstractEventLoop:
        return _VirtualLoop(self)

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        """Run ``main`` to completion on a fresh virtual-time loop (blocking, like asyncio.run)."""
        with asyncio.Runner(loop_factory=self.new_loop) as runner:
            return runner.run(main)


def run_virtual(
    main: Callable[[VirtualClock], Awaitable[T]], start: float = 0.0
) -> tuple[T, VirtualClock]:
    """Run ``main(clock)`` in virtual time; returns its result and the clock (for elapsed time).

    The synchronous entry point for tests and benchmarks::

        result, clock = run_virtual(lambda clock: scenario(SimulatedEngine(cfg, clock=clock)))
    """
    clock = VirtualClock(start)

    async def wrapper() -> T:
        return await main(clock)

    return clock.run(wrapper()), clock
