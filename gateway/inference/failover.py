"""One request across attempts: retried on another target before its first token, never after.

``Failover`` looks like a ``Submission`` to the relay (``events``, ``pending``, ``cancel``,
``request_id``). Until the first token arrives it watches the attempt:

- a retryable error that is the pool's fault (``serving.health.POOL_FAILURES``: worker lost,
  engine or upstream error, a broken stream) counts against the pool's breaker and, while the
  route allows another attempt and the request's first-token deadline leaves time, the request
  is submitted again on another target (``next_attempt``): the client sees nothing of it;
- every ``WATCH_S`` it asks whether the attempt's pool still has a live worker; when none is
  left (its only worker was killed) and another target can take the request, it cancels the
  attempt (a queued request is removed and settled with nothing billed) and moves on the same
  way, instead of waiting for a worker that is not there. With no other target the request
  keeps its place in the queue (a restarted worker serves it, or its deadline ends it).

After the first token nothing is retried: the error event stands, as before. Each attempt is
its own admitted request (id ``{rid}-{n}``), settled and metered once by whoever ends it; an
attempt that failed before its first token generated nothing for the client, so nothing is
charged twice. All attempts share the first one's deadlines.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.inference.routes import Target
from serving import health
from serving.submission import ErrorEvent, Event, FinishEvent, Submission, TokenEvent

log = logging.getLogger(__name__)
WATCH_S = 0.5
MIN_LEFT_S = 0.5  # a retry needs at least this much of the first-token deadline left

POOL_DOWN = ErrorEvent(
    "pool_down", "No worker of the pool serving this request is alive, and no other can take "
    "it; please retry.", retryable=True)

NextAttempt = Callable[[str], Awaitable[tuple[Target, Submission] | None]]
CanMove = Callable[[], Awaitable[bool]]


class Failover:
    def __init__(self, target: Target, first: Submission, next_attempt: NextAttempt,
                 on_switch: Callable[[Target], None] | None = None,
                 can_move: CanMove | None = None) -> None:
        self.target = target
        self.current = first
        self.rate_limit = first.rate_limit
        self._next_attempt = next_attempt
        self._on_switch = on_switch
        self._can_move = can_move
        self.attempts: list[tuple[str, str]] = [(target.pool.name, first.request_id)]
        self._abandoned = False

    @property
    def request_id(self) -> str:
        return self.current.request_id

    def pending(self) -> bool:
        return self.current.pending()

    async def cancel(self, reason: str = "client_disconnect") -> None:
        await self.current.cancel(reason)

    async def events(self) -> AsyncIterator[Event]:
        while True:
            got_token = retry = False
            watch = asyncio.create_task(self._watch(self.target.pool.name, self.current))
            try:
                async for event in self.current.events():
                    if isinstance(event, TokenEvent):
                        if not got_token:
                            got_token = True
                            watch.cancel()
                            self._record(True)
                        yield event
                        continue
                    if not got_token:
                        if self._failed_here(event):
                            self._record(False)
                            retry = await self._switch(event)
                            if retry:
                                break
                            if self._abandoned:  # cancelled by us, and nowhere to go after all
                                yield POOL_DOWN
                                return
                        elif isinstance(event, FinishEvent):
                            self._record(True)
                    yield event
                    return
            finally:
                watch.cancel()
            if not retry:
                return

    def _failed_here(self, event: Event) -> bool:
        if isinstance(event, ErrorEvent):
            return health.counts_against_pool(event.code, event.retryable)
        # Our own watchdog cancelled a request stuck on a pool without workers.
        return isinstance(event, FinishEvent) and self._abandoned

    async def _switch(self, event: Event) -> bool:
        left = self.current.first_token_left()
        if left < MIN_LEFT_S:
            return False
        code = getattr(event, "code", "pool_down")
        found = await self._next_attempt(code)
        if found is None:
            return False
        target, sub = found
        sub.share_deadlines(self.current)
        log.info("request %s: %s on pool %s before its first token; retried on %s as %s",
                 self.attempts[0][1], code, self.target.pool.name, target.pool.name,
                 sub.request_id)
        self.target, self.current, self._abandoned = target, sub, False
        self.attempts.append((target.pool.name, sub.request_id))
        if self._on_switch is not None:
            self._on_switch(target)
        return True

    async def _watch(self, pool: str, sub: Submission) -> None:
        """Until the first token: give up on a pool whose workers are all gone."""
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                live = await health.live_workers([pool])
            except Exception:  # Redis unreachable: the relay's own outage handling decides
                continue
            if live.get(pool, 0) == 0:
                # Only when another target can take it: with none, the request keeps its place
                # (a supervisor restarting the worker serves it, or its deadline ends it).
                if self._can_move is None or not await self._can_move():
                    continue
                self._abandoned = True
                await sub.cancel("pool_down")
                return

    def _record(self, ok: bool) -> None:
        """The breaker hears the outcome without the response waiting for it (successes
        coalesced per pool: ``serving.health.note``)."""
        health.note(self.target.pool.name, ok)
