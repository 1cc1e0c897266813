"""One place that knows where Redis is, and hands out clients to it.

Sync clients serve Django views, Celery tasks and management commands; async clients serve the
ASGI hot path. Both are cached per process (and per event loop for async) so a request never pays
for a new connection.

With ``REDIS_SENTINELS`` set, every client reaches the master through Redis Sentinel: a
connection asks the sentinels where the master is, and one that finds it gone (refused, or
demoted to a read-only replica) is dropped and retried against the new master (ADR
"beyond-redis-sentinel").

With ``REDIS_CLUSTER_NODES`` set, every client is redis-py's ``RedisCluster``: it routes each
command (and each script, by its first key) to the node that owns the key's slot. Keys carry
hash tags (``tag``, ``tenant_tag``, ``pool_tag``), so every script and multi-key command stays in
one slot (ADR 0018). Celery's broker stays a plain Redis (``CELERY_BROKER_URL`` or ``REDIS_URL``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any, cast

import hiredis
import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.asyncio.sentinel as aiosentinel
import redis.cluster
import redis.sentinel
from django.conf import settings
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import parse_url
from redis.driver_info import DriverInfo
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry
from redis.utils import HIREDIS_AVAILABLE, get_lib_version

from infra.embedded_redis import ensure_embedded_redis
from infra.loop_local import LoopLocal


def sentinel_mode() -> bool:
    return bool(settings.REDIS_SENTINEL_NODES)


def cluster_mode() -> bool:
    return bool(settings.REDIS_CLUSTER_NODES)


@lru_cache(maxsize=1)
def redis_url() -> str:
    if settings.REDIS_URL:
        return settings.REDIS_URL
    if sentinel_mode():
        raise RuntimeError("Redis is reached through REDIS_SENTINELS: there is no single URL")
    if cluster_mode():
        raise RuntimeError("Redis is a cluster (REDIS_CLUSTER_NODES): set REDIS_URL or "
                           "CELERY_BROKER_URL to a plain Redis for Celery's broker")
    url = ensure_embedded_redis(settings.VAR_DIR)
    # Children (uvicorn workers, Celery) inherit the address rather than each probing for it.
    os.environ["REDIS_URL"] = url
    return url


def _backoff() -> ExponentialWithJitterBackoff:
    return ExponentialWithJitterBackoff(base=0.05, cap=1.0)


@lru_cache(maxsize=1)
def driver_info() -> DriverInfo:
    """What every connection sends in CLIENT SETINFO, built once per process.

    Left to redis-py, each new connection reads the package's own version from its installed
    metadata (importlib.metadata, a scan of every installed distribution): 2.7 ms of CPU per
    connection here, 0.01 ms with this passed in. A burst of concurrent requests opens that
    many pooled connections at once, on the request path (a third of a worker's CPU during
    the first burst of bench/vllm_vs_direct.py, and the time lands on first tokens)."""
    return DriverInfo(lib_version=get_lib_version())


def pool_kwargs() -> dict[str, Any]:
    """What every connection pool this module builds is given.

    Maintenance notifications (a Redis Enterprise / Cloud handoff protocol) are off. redis-py 8
    turns them on by itself ("auto") for RESP3, its new default, and with them on its pool
    skips the check that replaces a pooled connection the server closed (redis-py #4128): after
    a Redis restart, the first command on each stale connection failed. Commands behind
    redis-py's retry recovered, but the worker's step batch, sent on a raw connection, lost
    its tokens and ended those streams (stream_broken).
    """
    return {"driver_info": driver_info(),
            "maint_notifications_config": MaintNotificationsConfig(enabled=False)}


class _HiredisPacker:
    """Packs a command in one hiredis call, which encodes str, int, float and bytes itself.

    redis-py's own packer (``HiredisRespSerializer``) first encodes every argument in Python
    (an ``Encoder.encode`` of several ``isinstance`` checks each): about 1.5 us an argument,
    and admission's two scripts send some 150 of them per request (0.2 ms of the gateway's
    CPU, issue 30). hiredis writes the same bytes (floats as ``repr``, str as UTF-8, strict).
    Anything else it refuses (a bool, None, a bytearray) goes to redis-py's packer, which
    packs it or raises its own ``DataError`` as before.
    """

    __slots__ = ("_own",)

    def __init__(self, own: Any) -> None:
        self._own = own

    def pack(self, *args: Any) -> list[bytes]:
        sent = args
        try:
            first = args[0]
            # As redis-py: a command name with spaces ("CLIENT SETINFO") is several words.
            if isinstance(first, str):
                sent = (*first.encode().split(), *args[1:])
            elif b" " in first:
                sent = (*first.split(), *args[1:])
            return [hiredis.pack_command(sent)]
        except TypeError:
            return cast(list[bytes], self._own.pack(*args))


def native_packing(connection: Any) -> Any:
    """``connection`` packing its commands with ``_HiredisPacker`` (UTF-8, strict only: what
    hiredis encodes str as); returned for chaining."""
    own = getattr(connection, "_command_packer", None)
    encoder = connection.encoder
    if (HIREDIS_AVAILABLE and own is not None and not isinstance(own, _HiredisPacker)
            and encoder.encoding.lower().replace("-", "") == "utf8"
            and encoder.encoding_errors == "strict"):
        connection._command_packer = _HiredisPacker(own)
    return connection


class _NativePacking(aioredis.ConnectionPool):
    """A pool whose connections pack with hiredis (``native_packing``)."""

    def make_connection(self) -> Any:
        return native_packing(super().make_connection())  # type: ignore[no-untyped-call]


class _BlockingPool(_NativePacking, aioredis.BlockingConnectionPool):
    """redis-py's blocking pool, packing with hiredis."""


class _Pool(_NativePacking):
    """redis-py's pool, packing with hiredis."""


def _master_kwargs() -> dict[str, Any]:
    """db, username and password for the master: from REDIS_URL when it is set."""
    parsed: dict[str, Any] = (
        parse_url(settings.REDIS_URL) if settings.REDIS_URL else {}  # type: ignore[no-untyped-call]
    )
    return {k: parsed[k] for k in ("db", "username", "password") if parsed.get(k) is not None}


def _cluster_kwargs() -> dict[str, Any]:
    """username and password for the cluster's nodes, from REDIS_URL when it is set (a cluster
    has only db 0, so REDIS_URL's db is not used)."""
    return {k: v for k, v in _master_kwargs().items() if k != "db"}


@lru_cache(maxsize=1)
def get_redis() -> redis.Redis:
    if cluster_mode():
        # Typed as redis.Redis for callers: RedisCluster answers the same commands (one slot per
        # call), and re-reads the slot map and retries when a slot moved (MOVED/ASK).
        nodes = [redis.cluster.ClusterNode(h, p)  # type: ignore[no-untyped-call]
                 for h, p in settings.REDIS_CLUSTER_NODES]
        return cast(redis.Redis, redis.cluster.RedisCluster(
            startup_nodes=nodes, health_check_interval=30, retry=Retry(_backoff(), 3),
            **_cluster_kwargs()))
    if sentinel_mode():
        sentinel = redis.sentinel.Sentinel(
            settings.REDIS_SENTINEL_NODES, socket_timeout=1.0)
        # Unlike from_url's, this client retries: a command that meets a failover (refused, or
        # the old master answering READONLY) reconnects to the master the sentinels name now.
        return cast(redis.Redis, sentinel.master_for(
            settings.REDIS_SENTINEL_MASTER, connection_pool_class=_FollowingSentinelPool,
            health_check_interval=30,
            retry=Retry(_backoff(), 3), **pool_kwargs(), **_master_kwargs()))
    return redis.Redis.from_url(redis_url(), health_check_interval=30, **pool_kwargs())


def new_redis() -> redis.Redis:
    """A sync client of its own (not the process's shared one), in whichever mode is set."""
    return get_redis.__wrapped__()


ASYNC_MAX_CONNECTIONS = 512
ASYNC_POOL_TIMEOUT_S = 10.0


def _new_async_client() -> aioredis.Redis:
    # A blocking pool: past ASYNC_MAX_CONNECTIONS a caller waits for a free connection.
    # redis-py's default async pool instead raises MaxConnectionsError at 100, which failed
    # requests (and worker settlements) whenever a burst had >100 Redis calls in flight.
    # A pool built this way gets no retry policy of its own (redis-py gives one only to
    # clients that build their pool): without it, the first command on a connection that a
    # Redis restart broke fails instead of reconnecting (seen as a 503 right after a restart).
    if cluster_mode():
        return _new_async_cluster()
    options: dict[str, Any] = {"max_connections": ASYNC_MAX_CONNECTIONS,
                               "timeout": ASYNC_POOL_TIMEOUT_S, "health_check_interval": 30,
                               "retry": AsyncRetry(_backoff(), 3), **pool_kwargs()}
    if sentinel_mode():
        return cast(aioredis.Redis, _async_sentinel().master_for(
            settings.REDIS_SENTINEL_MASTER, connection_pool_class=_BlockingSentinelPool,
            **options, **_master_kwargs()))
    pool = _BlockingPool.from_url(redis_url(), **options)
    return aioredis.Redis(connection_pool=pool)


def _new_async_cluster() -> aioredis.Redis:
    # redis-py's async cluster keeps one connection list per node and has no blocking pool (it
    # raises at its cap), so the per-node cap is set well above a single Redis's.
    nodes = [aiocluster.ClusterNode(h, p) for h, p in settings.REDIS_CLUSTER_NODES]
    return cast(aioredis.Redis, aiocluster.RedisCluster(
        startup_nodes=nodes, max_connections=ASYNC_MAX_CONNECTIONS * 4,
        retry=AsyncRetry(_backoff(), 3), **_cluster_kwargs()))


# How often a Sentinel pool asks the sentinels where the master is (as a connection is taken).
MASTER_CHECK_S = 0.5


class _MasterWatch:
    """When a Sentinel pool asks the sentinels again: every MASTER_CHECK_S, and at once after
    any pool of this process saw the master move, so a process's pools move together (a
    gateway must not admit on the old master while its stream relay reads the new one)."""

    moves = 0  # master moves seen by any pool of this process

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # a test's own clock, not the process's time.monotonic patched
        self.checked_at = 0.0
        self.moves_seen = 0

    def due(self) -> bool:
        now = self.clock()
        if self.moves_seen == _MasterWatch.moves and now - self.checked_at < MASTER_CHECK_S:
            return False
        self.checked_at, self.moves_seen = now, _MasterWatch.moves
        return True

    def saw(self, before: Any, after: Any) -> None:
        if before is not None and after != before:
            _MasterWatch.moves += 1
            self.moves_seen = _MasterWatch.moves


def _stale(connection: Any, master: Any) -> bool:
    return bool(master and connection.is_connected
                and (connection.host, connection.port) != tuple(master))


class _FollowingSentinelPool(redis.sentinel.SentinelConnectionPool):
    """A Sentinel pool that follows a failover within MASTER_CHECK_S (ADR 0016).

    redis-py asks the sentinels only when it opens a connection, so pooled connections keep
    talking to a demoted primary until it answers READONLY. After a forced or partitioned
    failover the old primary takes writes for as long as the sentinels take to reconfigure it
    (about 10 s, their INFO period), and drops them when it becomes a replica: settles,
    heartbeats, claims and whole requests lost, and a process whose pools disagree on the
    master (seen in tests/test_faults_sentinel.py). So the pool asks again as a connection is
    taken (_MasterWatch); a changed answer drops idle connections (redis-py's own
    get_master_address), and a taken one still on the old primary reconnects before use.
    """

    _watch: _MasterWatch | None = None

    def check_master(self) -> None:
        self._watch = self._watch or _MasterWatch()
        if self._watch.due():
            before = self.master_address
            with contextlib.suppress(redis.RedisError):  # none known mid-failover: carry on
                self.get_master_address()  # type: ignore[no-untyped-call]
            self._watch.saw(before, self.master_address)

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        self.check_master()
        connection: Any = super().get_connection(*args, **kwargs)
        if _stale(connection, self.master_address):
            connection.disconnect()
            connection.connect()
        return connection


class _AsyncFollowingSentinelPool(_NativePacking, aiosentinel.SentinelConnectionPool):
    """The asyncio twin of _FollowingSentinelPool (redis-py's classes differ by sync/async)."""

    _watch: _MasterWatch | None = None

    async def check_master(self) -> None:
        self._watch = self._watch or _MasterWatch()
        if self._watch.due():
            before = self.master_address
            with contextlib.suppress(redis.RedisError):
                await self.get_master_address()  # type: ignore[no-untyped-call]
            self._watch.saw(before, self.master_address)

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        await self.check_master()
        connection = await super().get_connection(  # type: ignore[no-untyped-call]
            *args, **kwargs)
        if _stale(connection, self.master_address):
            await connection.disconnect()
            await connection.connect()
        return connection


async def on_master(pool: aioredis.ConnectionPool, connection: Any) -> bool:
    """False once the sentinels name another master than the one ``connection`` (made by
    ``pool``, and held outside it: the stream relay's) talks to; True outside Sentinel."""
    if not isinstance(pool, _AsyncFollowingSentinelPool):
        return True
    await pool.check_master()
    return not _stale(connection, pool.master_address)


class _BlockingSentinelPool(_AsyncFollowingSentinelPool, aioredis.BlockingConnectionPool):
    """Finds the master through the sentinels, follows it, and waits for a free connection at
    the cap."""


def _async_sentinel() -> aiosentinel.Sentinel:
    return aiosentinel.Sentinel(
        settings.REDIS_SENTINEL_NODES, socket_timeout=1.0)


def new_async_pool(**options: Any) -> aioredis.ConnectionPool:
    """A separate asyncio pool (the stream relay's own blocking connection), Sentinel-aware.

    A Sentinel pool's connections refer to their pool weakly: keep the pool while they live.
    """
    if sentinel_mode():
        return _AsyncFollowingSentinelPool(  # type: ignore[no-untyped-call]
            settings.REDIS_SENTINEL_MASTER, _async_sentinel(), **pool_kwargs(),
            **options, **_master_kwargs())
    return _Pool.from_url(redis_url(), **pool_kwargs(), **options)


async def new_async_pool_for(slot_key: str, **options: Any) -> aioredis.ConnectionPool:
    """A separate asyncio pool to the Redis that owns ``slot_key`` (the stream relay's blocking
    connection): under Redis Cluster, the node serving the key's slot now; otherwise as
    ``new_async_pool``. A slot that moves later answers MOVED: the caller drops the pool and
    asks again (``refresh_slots`` first)."""
    if not cluster_mode():
        return new_async_pool(**options)
    node = await _node_for(slot_key)
    return aioredis.ConnectionPool(host=node.host, port=node.port, **options,
                                   **pool_kwargs(), **_cluster_kwargs())


async def _node_for(slot_key: str) -> Any:
    client = cast(Any, get_async_redis())
    await client.initialize()
    return client.get_node_from_key(slot_key)


async def refresh_slots() -> None:
    """Re-read the cluster's slot map (after a MOVED seen outside redis-py's own routing)."""
    if cluster_mode():
        await cast(Any, get_async_redis()).nodes_manager.initialize()


_node_pools: LoopLocal[dict[tuple[str, int], aioredis.ConnectionPool]] = LoopLocal(dict)


async def async_pool_for(client: aioredis.Redis, slot_key: str) -> aioredis.ConnectionPool:
    """The pool to send hand-packed commands on (the worker's step batch) for ``slot_key``'s
    slot: ``client``'s own, or under Redis Cluster one kept per node for this event loop."""
    if not cluster_mode():
        return client.connection_pool
    node = await _node_for(slot_key)
    pools = _node_pools.get()
    pool = pools.get((node.host, node.port))
    if pool is None:
        pool = aioredis.ConnectionPool(host=node.host, port=node.port, **pool_kwargs(),
                                       **_cluster_kwargs())
        pools[(node.host, node.port)] = pool
    return pool


_pubsub_attempts = itertools.count()


def new_async_pubsub_client() -> aioredis.Redis:
    """A client to SUBSCRIBE with: close its PubSub, not the client (shared outside a cluster).

    Under Redis Cluster, PUBLISH reaches the subscribers on every node, so a subscriber talks
    to any one node through a plain client; each call takes the next of REDIS_CLUSTER_NODES, so
    a subscriber that lost its node resubscribes on another.
    """
    if not cluster_mode():
        return get_async_redis()
    nodes = settings.REDIS_CLUSTER_NODES
    host, port = nodes[next(_pubsub_attempts) % len(nodes)]
    return aioredis.Redis(host=host, port=port, **pool_kwargs(), **_cluster_kwargs())


def new_async_redis() -> aioredis.Redis:
    """An asyncio client of its own (the caller closes it), in whichever mode is set."""
    return _new_async_client()


async_clients: LoopLocal[aioredis.Redis] = LoopLocal(_new_async_client)


def get_async_redis() -> aioredis.Redis:
    """An asyncio client bound to the running loop (clients cannot cross event loops).

    Keyed by the loop's id but checked against the loop itself: a new loop can reuse a closed
    loop's id and must not be handed that loop's dead connections (``LoopLocal``).
    """
    return async_clients.get()


def is_outage(exc: BaseException) -> bool:
    """Redis is unreachable or cannot take writes now, so the same call may succeed later: a
    lost connection, a timeout, or a primary that lost its replicas (NOREPLICAS, ADR 0016)."""
    return isinstance(exc, redis.ConnectionError | redis.TimeoutError) or (
        isinstance(exc, redis.ResponseError) and str(exc).startswith("NOREPLICAS"))


def text(value: object) -> str:
    """A Redis reply element as text (redis-py hands back bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def key(*parts: object) -> str:
    """A namespaced Redis key: ``key("usage", "dead")`` -> ``igw:usage:dead``."""
    return ":".join([settings.REDIS_KEY_PREFIX, *(str(p) for p in parts)])


def tag(kind: str, ident: object) -> str:
    """A Redis Cluster hash tag: every key holding the same tag hashes to the same slot.

    Only the part between the first ``{`` and the next ``}`` is hashed, so an id with a ``}``
    would end the tag early; ids here are numbers and pool names (no braces, ``serving.wfq``).
    """
    return f"{{{kind}.{ident}}}"


def tenant_tag(tenant_id: object) -> str:
    """The slot of a tenant's admission state: its buckets, counters and its keys' ones."""
    return tag("t", tenant_id)


def pool_tag(pool: object) -> str:
    """The slot of a pool's queues, workers, requests and their token streams."""
    return tag("p", pool)


def pool_key(kind: str, pool: object, *parts: object) -> str:
    """``kind:{p.POOL}:parts...``: a key on the pool's slot."""
    return key(kind, pool_tag(pool), *parts)


def tenant_key(kind: str, tenant_id: object, *parts: object) -> str:
    """``kind:{t.TENANT}:parts...``: a key on the tenant's slot."""
    return key(kind, tenant_tag(tenant_id), *parts)
