"""The serving core's Redis key layout, in one place, below every package that reads it.

Admission, the WFQ dispatcher, the worker, settlement, the janitor, and the gateway's and
metering's readings (overload, routing, pool load, metrics, fairness) build these keys here and
nowhere else. Two slots (ADR 0018): a tenant's state carries ``{t.T}``, a pool's and its
requests' ``{p.P}``, so every script touches one slot. Each key's type, writers and meaning are
in docs/architecture.md ("Redis keys"); the scripts that change them state their invariants
next to their code (serving/lua/).
"""

from __future__ import annotations

from infra.redis_conn import key, pool_key, pool_tag, tenant_key

# -- a pool's slot {p.POOL} ---------------------------------------------------------------------


def req_key(pool: str, rid: str) -> str:
    """The request's state hash: tenant, key, pool, charges, state, timestamps, payload."""
    return pool_key("req", pool, rid)


def stream_key(pool: str, rid: str) -> str:
    """The request's token stream (one entry per engine step, the last one final)."""
    return pool_key("stream", pool, rid)


def deadlines_key(pool: str) -> str:
    """The pool's unsettled requests by settle-by time: the janitor's backstop."""
    return pool_key("deadlines", pool)


def workers_key(pool: str) -> str:
    """The pool's workers by last heartbeat (liveness)."""
    return pool_key("workers", pool)


def worker_key(pool: str, worker_id: str, part: str) -> str:
    """One of a worker's keys (``inflight``, ``load``, ``reaped``)."""
    return pool_key("worker", pool, worker_id, part)


def inflight_key(pool: str, worker_id: str) -> str:
    """The requests a worker runs; dispatch adds to it in the same script that pops the queue."""
    return worker_key(pool, worker_id, "inflight")


def wake_key(pool: str) -> str:
    """A capped list admission pushes to (enter.lua), so an idle worker's BLPOP returns."""
    return key("wake", pool_tag(pool))


WFQ_PARTS = ("heads", "items", "state", "last", "shift", "seen", "weight", "active")


def wfq_key(pool: str, part: str) -> str:
    """One of the pool's WFQ keys (``WFQ_PARTS``; layout in serving/lua/wfq/common.lua)."""
    return key("wfq", pool_tag(pool), part)


def wfq_queue_prefix(pool: str) -> str:
    """A tenant's queue is this prefix + its id (the scripts build it; same slot)."""
    return key("wfq", pool_tag(pool), "q", "")


def wfq_queue_key(pool: str, tenant_id: object) -> str:
    return wfq_queue_prefix(pool) + str(tenant_id)


# -- a tenant's slot {t.TENANT} -----------------------------------------------------------------


def bucket_key(tenant_id: object, scope: str, ident: object, kind: str) -> str:
    """A token bucket (``kind`` "in" or "out") of the tenant (``scope`` "tenant") or of one of
    its keys (``scope`` "key", ``ident`` the key's id)."""
    if scope == "tenant":
        return tenant_key("bucket", tenant_id, "tenant", kind)
    return tenant_key("bucket", tenant_id, "key", ident, kind)


def counter_key(name: str, tenant_id: object, scope: str = "tenant", ident: object = None) -> str:
    """A ``conc`` or ``streams`` counter of the tenant or one of its keys."""
    if scope == "tenant":
        return tenant_key(name, tenant_id, "tenant")
    return tenant_key(name, tenant_id, "key", ident)


def charges_keys(tenant_id: object) -> list[str]:
    """The tenant's release tokens (zset) and what each releases (hash): admit.lua, release.lua."""
    return [tenant_key("charges", tenant_id), tenant_key("charges", tenant_id, "what")]


# -- no slot ------------------------------------------------------------------------------------


def pools_key() -> str:
    """Every pool that has (had) a key on its slot: the janitor and the usage writer walk it."""
    return key("pools")
