"""Per-request pump tasks for engines that stream from something else (vLLM, an upstream server).

Each request gets a task that reads from the real engine and feeds a queue; ``generate`` relays
the queue. Cancelling the task is the abort: vLLM aborts a request whose ``generate()`` consumer
is cancelled, and closing an upstream connection makes the upstream stop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

from workers.engine.base import EngineError, TokenDelta


class PumpedStream:
    __slots__ = ("aborting", "done", "queue", "task")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[TokenDelta | EngineError] = asyncio.Queue()
        self.task: asyncio.Task[Any] | None = None
        self.done = False  # the pump ended by itself: nothing left to cancel
        # The pump was cancelled (an abort, a consumer gone): whatever ends it from then on,
        # an error raised by the engine's own abort included, is the abort (see the pumps).
        self.aborting = False

    def cancel(self) -> None:
        self.aborting = True
        if self.task is not None:
            self.task.cancel()


class PumpedStreams(dict[str, PumpedStream]):
    """The running requests of one engine, by request id."""

    async def relay(
        self, request_id: str, pump: Callable[[PumpedStream], Coroutine[Any, Any, None]]
    ) -> AsyncGenerator[TokenDelta, None]:
        """Start ``pump(stream)`` and yield its deltas until one finishes; raise its errors."""
        if request_id in self:
            raise EngineError(f"request {request_id} is already running", retryable=False)
        stream = self[request_id] = PumpedStream()
        stream.task = asyncio.get_running_loop().create_task(pump(stream))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, EngineError):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Consumer closed or cancelled early: cancelling the pump is the abort.
            if not stream.done:
                stream.cancel()
            self.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Cancel the request's pump and wait until the engine behind it has been told."""
        stream = self.get(request_id)
        if stream is None or stream.task is None or stream.done:
            return
        stream.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([stream.task])
