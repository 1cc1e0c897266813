"""Route a model to a pool: the tenant's dedicated pool first, then shared pools in its region.

Among several shared pools, the least loaded wins: (requests queued in the pool's WFQ + requests
its workers hold) / the running capacity of its live workers. Workers publish their load with
each heartbeat (``workers:{pool}`` zset of live workers, ``worker:{wid}:load`` hash); a pool with
no live worker ranks after every pool with one, so a request is not sent where nothing will
serve it while another pool could. The pool table is read from the database at
most every ``TTL`` seconds per process: routing is on every request's path, pools change rarely.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from django.conf import settings
from django.db import DatabaseError, InterfaceError
from django.db.models import QuerySet

from catalog.models import Pool, ServedModel
from gateway.inference.errors import ApiError, model_not_found, unavailable
from gateway.orm import in_thread
from infra.keyspace import wfq_key
from infra.pool_workers import queue_live_workers, queue_load
from infra.redis_conn import get_async_redis
from serving import availability
from serving.adapters import AdapterCatalog, AdapterConfigError, AdapterNotFound
from serving.availability import live_pools

log = logging.getLogger(__name__)
TTL = 2.0


@dataclass(frozen=True)
class ModelInfo:
    name: str
    tokenizer_path: str | None
    max_model_len: int
    created: int
    tool_call_parser: str = "hermes"  # how tool calls are read from its text (toolparsers)
    task: str = "generate"  # or "embed": served on /v1/embeddings only


@dataclass(frozen=True)
class PoolInfo:
    name: str
    region: str
    dedicated_to: int | None
    model: ModelInfo
    max_sequences: int = 64
    backend: str = "simulated"
    dialect: str = ""  # an upstream's dialect (workers.engine.upstream.DIALECTS)
    # The pool's LoRA adapters (tenant data: each serves only its owner) and, once routing
    # picked one for a request, its public name.
    adapters: AdapterCatalog = field(default_factory=AdapterCatalog, compare=False)
    adapter: str | None = None


@dataclass(frozen=True)
class Catalog:
    models: dict[str, ModelInfo]
    pools: tuple[PoolInfo, ...]

    def pools_for(self, model: str) -> list[PoolInfo]:
        return [p for p in self.pools if p.model.name == model]


_cache: tuple[float, Catalog] | None = None


def _load_catalog() -> Catalog:
    models = {
        m.name: ModelInfo(m.name, m.tokenizer_path or None, m.max_model_len,
                          int(m.created_at.timestamp()), m.tool_call_parser, m.task)
        for m in ServedModel.objects.all()
    }
    pools = tuple(
        PoolInfo(p.name, p.region, p.dedicated_to_id, models[p.model.name], p.max_sequences,
                 p.backend, str((p.backend_settings or {}).get("dialect") or "vllm"),
                 _adapters(p))
        for p in _cell_pools().select_related("model")
    )
    return Catalog(models, pools)


def _cell_pools() -> QuerySet[Pool]:
    """The enabled pools this gateway routes to: with cells, only its own cell's (their queues
    live in this cell's Redis, and only its workers read them)."""
    pools = Pool.objects.filter(enabled=True)
    return pools.filter(cell=settings.CELL) if settings.CELL else pools


def _adapters(pool: Pool) -> AdapterCatalog:
    try:
        return AdapterCatalog.of_pool(pool.name, pool.backend, dict(pool.backend_settings or {}))
    except AdapterConfigError:
        # A misconfigured adapter list must not take the pool's base model down with it; the
        # worker refuses to start on the same error, which is where an operator sees it.
        log.exception("ignoring the adapters of pool %s", pool.name)
        return AdapterCatalog()


# A name the cached table does not know reloads a table older than this, so a model added a
# moment ago is not refused (404) for up to TTL; a flood of unknown names costs at most one
# read of the table per this per process.
MISS_RELOAD_S = 0.5


async def catalog(max_age: float | None = None) -> Catalog:
    """The pool table, read at most every ``max_age`` seconds (default TTL, read at call time
    so a test may change it)."""
    global _cache
    now = time.monotonic()
    max_age = TTL if max_age is None else max_age
    if _cache is None or now - _cache[0] > max_age:
        try:
            _cache = (now, await in_thread(_load_catalog)())
        except (DatabaseError, InterfaceError):
            # The database is down: route with the table we have (pools change rarely, and
            # inference must outlive a database outage); retry the read after another TTL.
            if _cache is None:
                raise unavailable("The service is temporarily unavailable.") from None
            log.warning("pool table unreadable (database unavailable); using the cached one")
            _cache = (now, _cache[1])
    return _cache[1]


def forget_catalog() -> None:
    """Drop the cached pool table (tests, and after an admin change in this process)."""
    global _cache
    _cache = None
    availability.forget()
    _windows.clear()


# -- what the running workers serve ------------------------------------------------------------
#
# The pool table says what an operator wants; the workers serve what they were started with.
# After the admin raises a model's max_model_len, workers started before keep the old context
# window until they restart, and a request sized by the new one would be refused by the engine.
# Each worker advertises its window with its heartbeat; requests are sized by the smallest
# window among the pool's live workers (any of them may take the request), and by the table's
# value when none advertises one. Read at most every WINDOW_TTL seconds per process and pool.

WINDOW_TTL = 1.0
_windows: dict[str, tuple[float, int | None]] = {}


async def advertised_window(pool: str) -> int | None:
    """The smallest context window the pool's live workers advertise; None if none does."""
    now = time.monotonic()
    hit = _windows.get(pool)
    if hit is not None and now - hit[0] < WINDOW_TTL:
        return hit[1]
    client = get_async_redis()
    pipe = client.pipeline(transaction=False)
    queue_live_workers(pipe, pool)
    [wids] = await pipe.execute()
    windows: list[int] = []
    if wids:
        pipe = client.pipeline(transaction=False)
        for wid in wids:
            queue_load(pipe, pool, wid, "max_model_len")
        windows = [int(v) for [v] in await pipe.execute() if v]
    window = min(windows) if windows else None
    _windows[pool] = (now, window)
    return window


async def serving_model(pool: PoolInfo) -> ModelInfo:
    """The pool's model with the context window its running workers serve (see above)."""
    window = await advertised_window(pool.name)
    if window is None or window >= pool.model.max_model_len:
        return pool.model
    return replace(pool.model, max_model_len=window)


def candidates(cat: Catalog, model: str, tenant_id: int, region: str) -> list[PoolInfo]:
    """Pools that may serve this tenant's request, dedicated ones first."""
    pools = cat.pools_for(model)
    dedicated = [p for p in pools if p.dedicated_to == tenant_id]
    if dedicated:
        return dedicated
    return [p for p in pools if p.dedicated_to is None and _local(p, region)]


def _local(pool: PoolInfo, region: str) -> bool:
    # With cells the catalog holds only this cell's pools, and reaching this cell already chose
    # the region (requests are forwarded to the tenant's cells: docs/adr/0019).
    return bool(settings.CELL) or pool.region == region


@dataclass(frozen=True)
class PoolLoad:
    queued: int
    in_flight: int
    capacity: int

    @property
    def score(self) -> float:
        if self.capacity <= 0:
            return float("inf")
        return (self.queued + self.in_flight) / self.capacity


async def pool_loads(pools: list[PoolInfo]) -> list[PoolLoad]:
    """Two pipelined round trips: live workers and queue lengths, then each worker's load."""
    client = get_async_redis()
    pipe = client.pipeline(transaction=False)
    for p in pools:
        queue_live_workers(pipe, p.name)
        pipe.hlen(wfq_key(p.name, "items"))
    first = await pipe.execute()
    workers = [first[2 * i] for i in range(len(pools))]
    pipe = client.pipeline(transaction=False)
    for p, wids in zip(pools, workers, strict=True):
        for wid in wids:
            queue_load(pipe, p.name, wid, "in_flight", "max_running")
    loads = iter(await pipe.execute())
    out = []
    for i, wids in enumerate(workers):
        held = capacity = 0
        for _ in wids:
            in_flight, max_running = next(loads)
            held += int(in_flight or 0)
            capacity += int(max_running or 0)
        out.append(PoolLoad(int(first[2 * i + 1]), held, capacity))
    return out


def eligible(cat: Catalog, tenant_id: int, region: str) -> list[PoolInfo]:
    """Every pool that may serve this tenant: its dedicated pools and shared ones in its region."""
    return [p for p in cat.pools
            if p.dedicated_to == tenant_id or (p.dedicated_to is None and _local(p, region))]


def adapter_pools(cat: Catalog, name: str, tenant_id: int, region: str) -> list[PoolInfo]:
    """Pools holding this tenant's adapter ``name``, marked with it. Another tenant's adapter
    of that name is invisible: the result is empty, exactly as for an unknown model."""
    found = []
    for pool in eligible(cat, tenant_id, region):
        try:
            pool.adapters.resolve(name, tenant_id)
        except AdapterNotFound:
            continue
        found.append(replace(pool, adapter=name))
    return found


def _usable_by(cat: Catalog, model: str, tenant_id: int) -> bool:
    """Whether some enabled pool anywhere may serve this tenant the model (shared or its own).
    A model only other tenants' dedicated pools serve does not exist for it: it gets the same
    404 as an unknown name, never a 503 that would confirm the model is there."""
    return any(p.dedicated_to in (None, tenant_id) for p in cat.pools_for(model))


async def choose_pool(model: str, tenant_id: int, region: str,
                      allowed: frozenset[str], *, served_only: bool = True) -> PoolInfo:
    """The pool for a new request. ``served_only``: only pools a live worker serves (a
    resumed stream, already in Redis, needs none). New requests go through the router
    (gateway.inference.routes), which asks the same of each pool's breaker."""
    pools = await candidate_pools(model, tenant_id, region, allowed)
    pools = await served(pools) if served_only else pools
    if not pools:
        raise not_served(model)
    if len(pools) == 1:
        return pools[0]
    loads = await pool_loads(pools)
    return min(zip(pools, loads, strict=True), key=lambda pl: pl[1].score)[0]


def not_served(model: str) -> ApiError:
    """Configured, but no worker runs it: refused now, before anything is charged, rather
    than queued until the first-token deadline."""
    return unavailable(f"No worker is serving `{model}` right now; retry shortly.",
                       retry_after=5, code="model_not_served")


async def candidate_pools(model: str, tenant_id: int, region: str,
                          allowed: frozenset[str]) -> list[PoolInfo]:
    """Every pool that may serve this tenant ``model`` (no route configured): dedicated ones
    only when it has any. 404 for a model it cannot see, 503 when none is enabled here.
    Whether a worker serves them is the caller's question (``served``, the breakers)."""
    cat = await catalog()
    if model not in cat.models:
        cat = await catalog(min(MISS_RELOAD_S, TTL))
    pools: list[PoolInfo]
    if model in cat.models:
        if (allowed and model not in allowed) or not _usable_by(cat, model, tenant_id):
            raise model_not_found(model)
        pools = candidates(cat, model, tenant_id, region)
    else:
        # Not a base model: one of this tenant's adapters, allowed when its base model is.
        pools = [p for p in adapter_pools(cat, model, tenant_id, region)
                 if not allowed or p.model.name in allowed]
        if not pools:
            raise model_not_found(model)
        dedicated = [p for p in pools if p.dedicated_to == tenant_id]
        pools = dedicated or pools
    if not pools:
        # The model exists but nothing serves it for this tenant right now: retry later.
        raise unavailable(f"No pool serves `{model}` in your region right now.", retry_after=5,
                          code="no_pool")
    return pools


async def served(pools: list[PoolInfo]) -> list[PoolInfo]:
    """The pools among these that a live worker serves now (``serving.availability``)."""
    live = await live_pools({p.name for p in pools})
    return [p for p in pools if p.name in live]


async def visible_models(tenant_id: int, region: str, allowed: frozenset[str]) -> list[ModelInfo]:
    """Models this key may call and some live pool serves for its tenant, for GET /v1/models:
    a model is listed only while a worker can serve it."""
    cat = await catalog()
    pools = await served([p for p in eligible(cat, tenant_id, region)
                          if not allowed or p.model.name in allowed])
    found = {p.model.name: p.model for p in pools}
    for pool in pools:  # the tenant's own adapters, and no one else's
        for name in pool.adapters.visible_names(tenant_id):
            found.setdefault(name, replace(pool.model, name=name))
    return [found[n] for n in sorted(found)]
