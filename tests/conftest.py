"""Shared fixtures. Tests run against real PostgreSQL and real Redis (see scripts/test.sh)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypedDict

import pytest

# Real vLLM (the tiny model, one engine and one `vllm serve` per run): tests/vllm_fixtures.py.
pytest_plugins = ["tests.vllm_fixtures"]


class _WholeCluster:
    """A Redis Cluster client whose KEYS asks every primary (redis-py asks one node), so tests
    that list keys see the whole keyspace, as on one Redis."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def keys(self, pattern: str = "*") -> list[bytes]:
        return list(self._client.keys(pattern, target_nodes=self._client.PRIMARIES))


@pytest.fixture
def redis_client(settings):
    """A clean Redis for one test. The test DB index is dedicated to tests, so flushing is safe.

    Under ``REDIS_CLUSTER_NODES`` (tests/test_redis_cluster.py re-runs modules so) it is the
    cluster: flushed on every primary, KEYS answered by every primary.
    """
    from infra.redis_conn import cluster_mode, get_redis

    client = _WholeCluster(get_redis()) if cluster_mode() else get_redis()
    client.flushdb()
    yield client
    client.flushdb()


# Tests make many users: hash their passwords at one PBKDF2 iteration (tests/fast_hasher.py).
FAST_HASHERS = ["tests.fast_hasher.FastPBKDF2PasswordHasher"]


@pytest.fixture(autouse=True, scope="session")
def fast_passwords():
    """One fast password hasher for the whole run (never in production settings)."""
    from django.test import override_settings

    with override_settings(PASSWORD_HASHERS=FAST_HASHERS):
        yield


def _allow_audit_truncate(sender: Any, connection: Any, **kwargs: Any) -> None:
    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute("SET igw.audit_truncate = 'allow'")


@pytest.fixture(autouse=True, scope="session")
def audit_truncate_for_flush():
    """Transactional tests empty the database with one TRUNCATE of every table; the audit
    log refuses TRUNCATE (contentlog migration 0004) unless the session allows it, which only
    this harness does (tests/test_audit_append_only_db.py resets it to test the refusal)."""
    from django.db import connections
    from django.db.backends.signals import connection_created

    connection_created.connect(_allow_audit_truncate)
    for conn in connections.all(initialized_only=True):
        if conn.connection is not None:
            _allow_audit_truncate(None, conn)
    yield
    connection_created.disconnect(_allow_audit_truncate)


@pytest.fixture(autouse=True, scope="session")
def fast_flush():
    """Transactional tests empty the database by DELETE of the tables that hold rows, not a
    TRUNCATE of all of them plus post_migrate (tests/fast_flush.py)."""
    from tests import fast_flush as flush

    undo = flush.install()
    yield
    undo()


@pytest.fixture(autouse=True, scope="session")
def fast_static():
    """Each test client's WhiteNoise middleware reuses one listing of the static files instead
    of listing and stat-ing them again (tests/fast_static.py)."""
    from tests import fast_static as static

    undo = static.install()
    yield
    undo()


class LiveSystem(TypedDict):
    """A running gateway and its pool's workers (real subprocesses)."""

    url: str
    port: int
    gateway: Any  # tests.procs.Proc
    worker: Any  # the first worker
    workers: dict[str, Any]  # worker id -> Proc
    pool: str


@pytest.fixture(scope="module")
def live_system(django_db_setup, django_db_blocker,
                redis_topology: str) -> Iterator[Callable[..., LiveSystem]]:
    """Start a live system: ``live_system(pool=..., worker_ids=[...], env=..., prepare=...)``.

    ``prepare`` puts the rows the processes read at start (it runs with the database open to
    this module-scoped fixture); the call returns once every worker has registered and the
    gateway answers. Whatever a module started stops when the module ends, or when the module
    moves on to its next Redis topology (the processes run on the topology they started on).
    """
    from contextlib import ExitStack

    from tests import procs

    with ExitStack() as stacks:

        def start(*, pool: str, worker_ids: Sequence[str], env: Mapping[str, str] | None = None,
                  prepare: Callable[[], object] | None = None) -> LiveSystem:
            if prepare is not None:
                with django_db_blocker.unblock():
                    prepare()
            up = stacks.enter_context(procs.stack(dict.fromkeys(worker_ids, pool), env))
            return LiveSystem(url=up.url, port=int(up.url.rsplit(":", 1)[1]),
                              gateway=up.gateway, worker=next(iter(up.workers.values())),
                              workers=up.workers, pool=pool)

        yield start


# ---- Redis topologies ------------------------------------------------------------------------
# A test marked ``redis_topologies("single", "cluster")`` (module-wide through ``pytestmark``,
# or one test; the closest mark wins) runs once per topology: "single" is the test Redis,
# "cluster" a real three-primary Redis Cluster (tests/redis_cluster.py, ADR 0018). Under the
# cluster every client of this process is a cluster client (``REDIS_CLUSTER_NODES``), the
# processes a test starts inherit the setting (tests/procs.py child_env), and ``redis_client``
# is the cluster; Redis Cluster refuses a script or a multi-key command whose keys span slots
# (CROSSSLOT), so a key that lost its hash tag fails those tests. The cluster variants start
# processes, so they are ``integration`` (out of the unit lane).
TOPOLOGIES_MARK = "redis_topologies"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    mark = metafunc.definition.get_closest_marker(TOPOLOGIES_MARK)
    if mark is None:
        return
    params = [pytest.param(name, marks=[pytest.mark.integration] if name != "single" else [])
              for name in mark.args]
    metafunc.parametrize("redis_topology", params, indirect=True, scope="module")


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Any]:
    """One real Redis Cluster for this (xdist worker) process, started when first asked for."""
    from tests.redis_cluster import RedisCluster

    started = RedisCluster().start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module", autouse=True)
def redis_topology(request: pytest.FixtureRequest) -> Iterator[str]:
    """The Redis topology the module's tests run on now ("single" unless parametrized)."""
    topology = getattr(request, "param", "single")
    if topology == "single":
        yield topology
        return
    assert topology == "cluster", topology
    from django.test import override_settings

    from tests.redis_cluster import fresh_redis_clients

    cluster = request.getfixturevalue("redis_cluster")
    with override_settings(REDIS_CLUSTER_NODES=[("127.0.0.1", p) for p in cluster.ports]):
        fresh_redis_clients()
        try:
            yield topology
        finally:
            fresh_redis_clients()
