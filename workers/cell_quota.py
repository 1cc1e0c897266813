"""The periodic rebalance of split quotas across cells (``serving.cells``, docs/adr/0019).

Runs under every cell's Celery beat; a PostgreSQL advisory lock (the one database all cells
share) lets one run at a time, because the headroom arithmetic of ``serving.cells.rebalance``
assumes no other writer grows a share meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import cache

import redis
import redis.cluster
from django.conf import settings
from django.db import connection, transaction

from infra.redis_conn import pool_kwargs
from serving import cells
from tenants.limits import quota_table, resolve
from tenants.models import Tenant

log = logging.getLogger(__name__)

LOCK_ID = 0x16C3_0019  # pg_advisory_xact_lock key of the rebalancer
SOCKET_TIMEOUT_S = 2.0


CLUSTER_SCHEME = "+cluster://"  # redis+cluster://host:port: that cell's Redis is a Redis Cluster


@cache
def cell_client(url: str) -> redis.Redis:
    """A client for one cell's Redis; short timeouts: a dead cell must not stall the others.

    ``redis+cluster://`` (or ``rediss+cluster://``) names one node of a cell that runs Redis
    Cluster (docs/adr/0018): the client finds the rest, and the share script runs on the
    tenant's slot like admission does."""
    timeouts = {"socket_timeout": SOCKET_TIMEOUT_S, "socket_connect_timeout": SOCKET_TIMEOUT_S}
    if CLUSTER_SCHEME in url:
        seed = url.replace(CLUSTER_SCHEME, "://", 1)
        return redis.cluster.RedisCluster.from_url(seed, **timeouts)  # type: ignore[return-value]
    # The project's pool settings: a cell's Redis that restarted is not "unreachable" for one
    # rebalance because of a stale pooled connection (infra.redis_conn.pool_kwargs).
    return redis.Redis.from_url(url, **timeouts, **pool_kwargs())


def split_tenants() -> list[Tenant]:
    """Active tenants served in more than one cell."""
    return [t for t in Tenant.objects.active().exclude(extra_cells="").prefetch_related("quotas")
            if len(t.cells) > 1]


def rebalance_all(
    client_for: Callable[[str], redis.Redis] | None = None,
) -> list[cells.Rebalance]:
    """Rebalance every split tenant once; [] when another rebalancer holds the lock."""
    urls: Mapping[str, Mapping[str, str]] = settings.CELLS
    get = client_for or (lambda cell: cell_client(urls[cell]["redis_url"]))
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cur:
                cur.execute("SELECT pg_try_advisory_xact_lock(%s)", [LOCK_ID])
                if not cur.fetchone()[0]:
                    return []
        results = []
        for tenant in split_tenants():
            known = [c for c in tenant.cells if c in urls]
            if len(known) < len(tenant.cells):
                log.warning("tenant %s: cells %s are not configured; not rebalanced",
                            tenant.slug, sorted(set(tenant.cells) - set(known)))
                continue
            quota = cells.quota_of(resolve(quota_table(tenant).get(None)))
            result = cells.rebalance(
                tenant.pk, quota, {c: get(c) for c in known}, floor=settings.CELL_SHARE_FLOOR,
                wait_replicas=settings.CELL_SHARE_WAIT_REPLICAS)
            if result.skipped or result.failed:
                log.info("tenant %s: rebalance %s%s", tenant.slug, result.skipped or "partial",
                         f", failed in {result.failed}" if result.failed else "")
            results.append(result)
        return results
