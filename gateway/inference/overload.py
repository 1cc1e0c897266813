"""Overload shedding: when a pool is overloaded, refuse (503) the tenants furthest over their share.

Two readings of the pool's WFQ state, in one pipelined round trip:

- overloaded: more requests queued than ``SHED_QUEUE_FACTOR`` times the running capacity of its
  live workers. By Little's law the queue wait grows with that ratio, so this is the queue-wait
  threshold in a form that needs no clock: the factor is roughly "queue wait in units of one
  request's service time";
- a tenant's virtual backlog: its last finish tag minus the pool's virtual time. Under WFQ that
  is the service, in cost per unit of weight, queued ahead of the tenant's next request. A
  tenant within its fair share has almost none; one flooding the pool has a lot. Because tags
  grow by cost / weight, a lower tier builds the same backlog with less work: the lowest tiers
  are shed first, and a tenant within its fair share is never shed while others exceed theirs.

A shed request is refused before anything is charged, with Retry-After; nothing here writes.
The reading rides in the router's pipeline (its breaker checks), so it costs no round trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.conf import settings

from gateway.inference.errors import unavailable
from infra.keyspace import wfq_key
from infra.pool_workers import queue_live_count
from infra.redis_conn import get_async_redis

SHED_RETRY_AFTER_S = 5


Reading = tuple[int, int, float]  # (queued requests, live workers, the tenant's backlog)
READS = 4  # replies ``queue_reading`` adds to a pipeline


def queue_reading(pipe: Any, pool: str, tenant_id: object) -> None:
    """Add the reading's ``READS`` commands to a pipeline (the router's, so the reading costs
    no round trip of its own: issue 30); ``parse_reading`` turns their replies into one."""
    pipe.hlen(wfq_key(pool, "items"))
    queue_live_count(pipe, pool)
    pipe.hget(wfq_key(pool, "state"), "vtime")
    pipe.hget(wfq_key(pool, "last"), str(tenant_id))


def parse_reading(replies: Sequence[Any]) -> Reading:
    queued, workers, vtime, last = replies
    backlog = max(0.0, float(last or 0) - float(vtime or 0))
    return int(queued), int(workers), backlog


async def reading(pool: str, tenant_id: object) -> Reading:
    """(queued requests, live workers, the tenant's virtual backlog), in a round trip."""
    pipe = get_async_redis().pipeline(transaction=False)
    queue_reading(pipe, pool, tenant_id)
    return parse_reading(await pipe.execute())


def enabled() -> bool:
    return float(settings.SHED_QUEUE_FACTOR) > 0


async def check(pool: str, max_sequences: int, tenant_id: object,
                read: Reading | None = None) -> None:
    """Raise a 503 if the pool is overloaded and this tenant is over its share. ``read``: a
    reading taken already (the router's pipeline), else one is taken here."""
    factor = settings.SHED_QUEUE_FACTOR
    if factor <= 0:
        return  # shedding disabled
    queued, workers, backlog = read if read is not None else await reading(pool, tenant_id)
    if queued <= factor * workers * max_sequences:
        return
    # Cost units (WFQ_INPUT_PRICE x prompt + WFQ_OUTPUT_PRICE x output, divided by the weight).
    if backlog > settings.SHED_VIRTUAL_BACKLOG:
        raise unavailable(
            "The model is overloaded and you have more queued than your share; "
            "please retry later.", retry_after=SHED_RETRY_AFTER_S, code="overloaded")
