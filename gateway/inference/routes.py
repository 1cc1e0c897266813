"""Routes: a public model name served by several targets, and the choice of one per attempt.

A route (``catalog.models.Route``, set in the admin and at ``/api/routes/``) maps a public
model name to targets: pools, each with a weight and a priority. Without a route a model's
targets are the pools that serve it for this tenant (``pools.candidate_pools``), each with
weight 1 and priority 0: today's behaviour, with health checks and retries added.

A ``Router`` holds one request's plan (docs/adr/0024-routes-and-fairness-across-pools.md):

1. the chain of public names: the model asked for, then the request's own ``fallbacks``
   (``extra_body={"fallbacks": [...]}``, as LiteLLM reads them), then the tenant's
   (``TenantFallback``), then the route's; each must be a model this key may call;
2. for the first name with a usable target: among the targets of its best priority whose
   breaker lets a request through (``serving.health``; a pool with no live worker never
   does), one is drawn with probability proportional to ``weight / (1 + expected wait)``.
   The wait is this tenant's: how many requests its WFQ position puts ahead of its next one
   in that pool, against the pool's free slots and its engines' waiting queue;
3. a target that failed (a retryable error before the first token) or refused (overload) is
   not picked again for this request; the next pick moves to the next priority and then to the
   next name in the chain. Retries after failures are capped by the route's ``retries``
   (``ROUTE_RETRIES`` without a route).

A request's ``prompt_cache_key`` (OpenAI's field for requests sharing a long prefix) makes the
draw sticky: the same key lands on the same pool while its weight and wait allow, where the
engines' prefix cache already holds that prefix (``_rendezvous``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import DatabaseError, InterfaceError

from catalog.models import Route
from gateway.inference import overload, oversize
from gateway.inference.errors import ApiError, model_not_found, unavailable
from gateway.inference.pools import PoolInfo, candidate_pools, catalog, not_served
from gateway.orm import in_thread
from infra.keyspace import wfq_key, wfq_queue_key
from infra.pool_workers import queue_live_workers, queue_load
from infra.redis_conn import get_async_redis
from serving import health
from tenants.auth import Principal
from tenants.models import TenantFallback

log = logging.getLogger(__name__)
TTL = 2.0


@dataclass(frozen=True)
class RouteInfo:
    name: str
    targets: tuple[tuple[str, float, int], ...]  # (pool, weight, priority)
    retries: int | None
    fallbacks: tuple[str, ...]


@dataclass(frozen=True)
class RouteTable:
    routes: dict[str, RouteInfo]
    tenant_fallbacks: dict[tuple[int, str], tuple[str, ...]]


def _load() -> RouteTable:
    routes = {
        r.name: RouteInfo(r.name, tuple((t.pool.name, t.weight, t.priority)
                                        for t in r.targets.all()),
                          r.retries, tuple(r.fallbacks or ()))
        for r in Route.objects.filter(enabled=True).prefetch_related("targets__pool")
    }
    tenant = {(f.tenant_id, f.model): tuple(f.fallbacks or ())
              for f in TenantFallback.objects.all()}
    return RouteTable(routes, tenant)


_cache: tuple[float, RouteTable] | None = None


async def table() -> RouteTable:
    """The route table, read at most every TTL seconds per process (kept through a database
    outage, like the pool table)."""
    global _cache
    now = time.monotonic()
    if _cache is None or now - _cache[0] > TTL:
        try:
            _cache = (now, await in_thread(_load)())
        except (DatabaseError, InterfaceError):
            if _cache is None:
                raise unavailable("The service is temporarily unavailable.") from None
            log.warning("route table unreadable (database unavailable); using the cached one")
            _cache = (now, _cache[1])
    return _cache[1]


def forget_routes() -> None:
    global _cache
    _cache = None


@dataclass(frozen=True)
class Target:
    pool: PoolInfo
    weight: float
    priority: int
    name: str  # the public name it was reached under (the route's, or a fallback's)

    @property
    def served_model(self) -> str:
        """The model that actually serves: the adapter, or the pool's model."""
        return self.pool.adapter or self.pool.model.name


async def targets_for(model: str, principal: Principal) -> tuple[list[Target], RouteInfo | None]:
    """The targets of one public name for this principal. 404 when it may not see the name,
    503 ``no_pool`` when nothing is enabled for it here."""
    tab = await table()
    route = tab.routes.get(model)
    tenant, region = principal.tenant_id, principal.tenant_region
    allowed = principal.allowed_model_names
    if route is None:
        pools = await candidate_pools(model, tenant, region, allowed)
        return [Target(p, 1.0, 0, model) for p in pools], None
    if allowed and model not in allowed:
        raise model_not_found(model)
    by_name = {p.name: p for p in (await catalog()).pools}
    mine = [(by_name[n], w, pr) for n, w, pr in route.targets
            if n in by_name and by_name[n].dedicated_to in (None, tenant)]
    if not mine and not any(n in by_name for n, _, _ in route.targets):
        raise unavailable(f"No pool serves `{model}` in your region right now.",
                          retry_after=5, code="no_pool")
    if not mine:
        raise model_not_found(model)  # only other tenants' pools: it does not exist for this one
    dedicated = [t for t in mine if t[0].dedicated_to == tenant]
    local = [t for t in (dedicated or mine) if settings.CELL or t[0].region == region
             or t[0].dedicated_to == tenant]
    if not local:
        raise unavailable(f"No pool serves `{model}` in your region right now.",
                          retry_after=5, code="no_pool")
    return [Target(p, w, pr, model) for p, w, pr in local], route


# -- expected wait -----------------------------------------------------------------------------


async def expected_waits(targets: Sequence[Target], tenant_id: int) -> list[float]:
    """For each target, about how many slot-turns this tenant's next request would wait.

    Under WFQ a backlogged tenant's next request is served after about (its own queue + 1)
    rounds of every active tenant's requests, and never after more than everything queued;
    the engines' own waiting requests come first; free slots take that many at once. Two
    pipelined round trips for all targets. A pool without capacity waits forever (inf).
    """
    pipe = get_async_redis().pipeline(transaction=False)
    _queue_reads(pipe, targets, tenant_id)
    return await _waits(targets, await pipe.execute())


def _queue_reads(pipe: Any, targets: Sequence[Target], tenant_id: int) -> None:
    """The first round of ``expected_waits``: 4 replies per target."""
    for t in targets:
        name = t.pool.name
        queue_live_workers(pipe, name)
        pipe.hlen(wfq_key(name, "items"))
        pipe.zcard(wfq_queue_key(name, tenant_id))
        pipe.zcard(wfq_key(name, "active"))


async def _waits(targets: Sequence[Target], first: Sequence[Any]) -> list[float]:
    """The second round of ``expected_waits``: the live workers' advertised load."""
    pipe = get_async_redis().pipeline(transaction=False)
    for i, t in enumerate(targets):
        for wid in first[4 * i]:
            queue_load(pipe, t.pool.name, wid, "in_flight", "max_running", "waiting")
    loads = iter(await pipe.execute())
    out = []
    for i in range(len(targets)):
        held = capacity = waiting = 0
        for _ in first[4 * i]:
            in_flight, max_running, engine_waiting = next(loads)
            held += int(in_flight or 0)
            capacity += int(max_running or 0)
            waiting += int(engine_waiting or 0)
        queued, mine, active = (int(v) for v in first[4 * i + 1:4 * i + 4])
        if capacity <= 0:
            out.append(float("inf"))
            continue
        ahead = min(queued, (mine + 1) * max(1, active)) + waiting
        out.append(max(0, ahead - max(0, capacity - held)) / capacity)
    return out


def draw(targets: Sequence[Target], waits: Sequence[float],
         rng: random.Random | None = None, affinity: bytes | None = None) -> Target:
    """One target, with probability proportional to weight / (1 + wait).

    With an ``affinity`` (the tenant's ``prompt_cache_key``), the same key keeps landing on the
    same target, where its shared prefix is already in the engines' prefix cache; across keys
    the picks still follow weight / (1 + wait) (``_rendezvous``)."""
    scores = [t.weight / (1.0 + w) for t, w in zip(targets, waits, strict=True)]
    total = sum(scores)
    if total <= 0:
        return targets[0]
    if affinity is not None:
        return _rendezvous(targets, scores, affinity)
    x = (rng or random).random() * total
    for t, s in zip(targets, scores, strict=True):
        x -= s
        if x < 0:
            return t
    return targets[-1]


def _rendezvous(targets: Sequence[Target], scores: Sequence[float], affinity: bytes) -> Target:
    """Weighted rendezvous hashing: each target draws a fixed uniform ``u`` from (affinity,
    pool) and the smallest ``-ln(u) / score`` wins. A key's winner changes only when scores
    move a lot or targets come and go, and over many keys each target wins in proportion to
    its score (the minimum of exponentials with rates ``score``)."""
    def rank(t: Target, score: float) -> float:
        if score <= 0:
            return math.inf
        digest = hashlib.blake2b(affinity + t.pool.name.encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "big") + 1) / (2**64 + 1)  # in (0, 1)
        return -math.log(u) / score

    return min(zip(targets, scores, strict=True), key=lambda ts: rank(*ts))[0]


def affinity_key(tenant_id: int, prompt_cache_key: str | None) -> bytes | None:
    """The tenant's ``prompt_cache_key`` as a routing affinity, scoped to the tenant (I1: two
    tenants' equal keys are unrelated)."""
    if not prompt_cache_key:
        return None
    return f"{tenant_id}\x00{prompt_cache_key}\x00".encode()


# -- one request's plan ------------------------------------------------------------------------


class Router:
    """One request's targets across priorities and fallbacks (see the module docstring)."""

    def __init__(self, model: str, principal: Principal, fallbacks: Sequence[str] = (),
                 prompt_cache_key: str | None = None) -> None:
        self.model = model
        self.principal = principal
        self.request_fallbacks = tuple(fallbacks)
        self.affinity = affinity_key(principal.tenant_id, prompt_cache_key)
        self.excluded: set[str] = set()  # pools tried (failed or refused) for this request
        self.failures = 0
        self.retries = settings.ROUTE_RETRIES
        self.reasons: dict[str, str] = {}  # pool -> why it was passed over (for the 503)
        self._chain: list[str] | None = None
        # Read in the last pick's pipeline, for the checks between the pick and admission
        # (gateway.inference.overload, .oversize): no round trip of their own (issue 30).
        self.overload_readings: dict[str, overload.Reading] = {}
        self.oversize_read: oversize.Count | None = None

    async def chain(self) -> list[str]:
        if self._chain is None:
            tab = await table()
            route = tab.routes.get(self.model)
            names = [self.model, *self.request_fallbacks,
                     *tab.tenant_fallbacks.get((self.principal.tenant_id, self.model), ()),
                     *(route.fallbacks if route else ())]
            self._chain = list(dict.fromkeys(names))
            if route is not None and route.retries is not None:
                self.retries = route.retries
        return self._chain

    def exclude(self, target: Target, reason: str) -> None:
        self.excluded.add(target.pool.name)
        self.reasons[target.pool.name] = reason

    def may_retry(self) -> bool:
        return self.failures < self.retries

    def _queue_checks(self, pipe: Any, names: Sequence[str]) -> None:
        tenant = self.principal.tenant_id
        if overload.enabled():
            for name in names:
                overload.queue_reading(pipe, name, tenant)
        oversize.queue_count(pipe, tenant)

    def _read_checks(self, names: Sequence[str], replies: Sequence[Any]) -> None:
        self.overload_readings = {}
        if overload.enabled():
            for i, name in enumerate(names):
                self.overload_readings[name] = overload.parse_reading(
                    replies[overload.READS * i:overload.READS * (i + 1)])
        self.oversize_read = oversize.Count(replies[-1])

    async def pick(self) -> Target:
        """The next target; 503 naming the model when none can serve now."""
        for name in await self.chain():
            try:
                targets, _ = await targets_for(name, self.principal)
            except ApiError:
                if name == self.model:
                    raise  # the model itself: its 404 or 503 is the answer
                continue  # a fallback this key may not call, or not served here: skip it
            found = await self._pick_among(targets)
            if found is not None:
                return found
        why = sorted(set(self.reasons.values())) or ["unavailable"]
        if why == ["no live worker"]:
            raise not_served(self.model)  # the same refusal as the model listing's (compat)
        raise unavailable(f"No deployment of `{self.model}` can serve this request right now "
                          f"({', '.join(why)}); please retry shortly.", retry_after=2,
                          code="model_unavailable")

    async def _pick_among(self, targets: list[Target]) -> Target | None:
        left = [t for t in targets if t.pool.name not in self.excluded]
        for priority in sorted({t.priority for t in left}):
            group = [t for t in left if t.priority == priority]
            # The breakers and the first round of the waits in one round trip.
            names = [t.pool.name for t in group]
            pipe = get_async_redis().pipeline(transaction=False)
            health.queue_checks(pipe, names)
            if len(group) > 1:
                _queue_reads(pipe, group, self.principal.tenant_id)
            own = len(pipe)
            self._queue_checks(pipe, names)
            replies = await pipe.execute()
            self._read_checks(names, replies[own:])
            healthy, reads = [], []
            for i, (t, v) in enumerate(zip(group, health.verdicts(names, replies[:len(names)]),
                                             strict=True)):
                if v.allowed:
                    healthy.append(t)
                    start = len(group) + 4 * i
                    reads += replies[start:start + 4]
                else:
                    self.reasons[t.pool.name] = ("no live worker" if v.reason == "no_worker"
                                                 else "circuit open")
            if not healthy:
                continue
            if len(healthy) == 1:
                return healthy[0]
            return draw(healthy, await _waits(healthy, reads), affinity=self.affinity)
        return None
