"""Gateway liveness: which process relays which request, so a dead gateway's requests stop.

A gateway process that dies (SIGKILL, OOM, a lost host) leaves its requests running in the
engine with nobody to read them; before this they ran to ``max_tokens`` and were billed for
tokens no client received. Now:

- each gateway event loop has an id and, every ``GATEWAY_HEARTBEAT_SECONDS``, in ONE pipeline:
  ``ZADD gateways {gid} now`` and the changes to ``gateway:{gid}:rids`` (the requests whose
  events it is relaying: SADD the new, SREM the finished), so the bookkeeping costs one round
  trip a second per process, not one per request;
- the janitor (``serving.janitor.reap_dead_gateways``) claims a gateway whose heartbeat is older
  than ``GATEWAY_DEAD_AFTER_SECONDS`` (``ZREM`` decides which janitor: exactly one wins), and
  cancels each of its requests that no live gateway is relaying (a client that resumed with
  ``Last-Event-ID`` elsewhere keeps its stream) with reason ``gateway_lost``: a queued one is
  removed and settled with nothing billed, a running one is aborted by its worker and billed
  for what it generated until then.

Bounds: a request opened less than one heartbeat before the crash may not be registered yet; it
then ends as before (at ``max_tokens``, or the deadline janitor). A client resuming on another
gateway must do so within ``GATEWAY_DEAD_AFTER_SECONDS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterator

from django.conf import settings

from infra.loop_local import LoopLocal
from infra.redis_conn import get_async_redis, key

log = logging.getLogger(__name__)


def gateways_key() -> str:
    return key("gateways")


def member(pool: str, rid: str) -> str:
    """A request as ``gateway:{gid}:rids`` holds it: its pool too, which its keys need."""
    return f"{pool}\t{rid}"


def parse_member(value: str) -> tuple[str, str]:
    """(pool, rid) of a ``member``."""
    pool, _, rid = value.partition("\t")
    return pool, rid


def rids_key(gid: str) -> str:
    return key("gateway", gid, "rids")


class Registry:
    """This event loop's relayed requests and its heartbeat task."""

    def __init__(self) -> None:
        self.gid = uuid.uuid4().hex[:16]
        self.held: dict[str, int] = {}  # rid -> how many relays of this loop read it
        self._added: set[str] = set()
        self._removed: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def hold(self, rid: str) -> None:
        self.held[rid] = self.held.get(rid, 0) + 1
        self._added.add(rid)
        self._removed.discard(rid)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._beat(), name="gw-liveness")

    def release(self, rid: str) -> None:
        left = self.held.get(rid, 0) - 1
        if left > 0:
            self.held[rid] = left
            return
        self.held.pop(rid, None)
        self._added.discard(rid)
        self._removed.add(rid)

    async def _beat(self) -> None:
        while True:
            try:
                await self.flush()
            except Exception:  # Redis away: the relay reports that; try again next beat
                log.warning("gateway heartbeat failed", exc_info=True)
            await asyncio.sleep(settings.GATEWAY_HEARTBEAT_SECONDS)

    async def flush(self) -> None:
        added, removed = self._added, self._removed
        self._added, self._removed = set(), set()
        r = get_async_redis()
        secs, micros = await r.time()
        pipe = r.pipeline(transaction=False)
        pipe.zadd(gateways_key(), {self.gid: secs + micros / 1e6})
        if added:
            pipe.sadd(rids_key(self.gid), *added)
        if removed:
            pipe.srem(rids_key(self.gid), *removed)
        # The set outlives a crash long enough for a janitor to find it.
        pipe.expire(rids_key(self.gid), int(settings.GATEWAY_DEAD_AFTER_SECONDS * 10) + 60)
        try:
            await pipe.execute()
        except BaseException:
            self._added |= added - set(self._removed)  # send them again next beat
            self._removed |= removed - set(self.held)
            raise


_registries: LoopLocal[Registry] = LoopLocal(Registry)


def registry() -> Registry:
    """This event loop's registry (its heartbeat task runs on the loop)."""
    return _registries.get()


@contextlib.contextmanager
def holding(pool: str, rid: str) -> Iterator[None]:
    """While the body runs, this gateway relays ``rid`` (see the module docstring)."""
    reg, held = registry(), member(pool, rid)
    reg.hold(held)
    try:
        yield
    finally:
        reg.release(held)
