"""Redis Sentinel settings and client construction (the failover itself: test_faults_sentinel)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel
from django.test import override_settings

from infra import redis_conn
from tests.redis_ha import SentinelGroup

ROOT = Path(__file__).resolve().parent.parent


def start(**env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "DJANGO_SETTINGS_MODULE": "gateway.settings", **env}
    return subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=ROOT,
                          env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("value", ["no-port", "h:0", "h:99999", "h:abc", "a:1,:2"])
@pytest.mark.integration
def test_bad_sentinel_address_names_the_setting(value: str) -> None:
    done = start(REDIS_SENTINELS=value, REDIS_SENTINEL_MASTER="m")
    assert done.returncode != 0
    assert "REDIS_SENTINELS" in done.stderr.strip().splitlines()[-1], done.stderr[-500:]


@pytest.mark.integration
def test_sentinels_without_a_master_name_stop_startup() -> None:
    done = start(REDIS_SENTINELS="127.0.0.1:26379", REDIS_SENTINEL_MASTER="")
    assert done.returncode != 0 and "REDIS_SENTINEL_MASTER" in done.stderr


@pytest.fixture
def fresh_clients() -> Iterator[None]:
    redis_conn.get_redis.cache_clear()
    redis_conn.redis_url.cache_clear()
    yield
    redis_conn.get_redis.cache_clear()
    redis_conn.redis_url.cache_clear()


NODES = [("10.0.0.1", 26379), ("10.0.0.2", 26380)]


@override_settings(REDIS_SENTINEL_NODES=NODES, REDIS_SENTINEL_MASTER="igw",
                   REDIS_URL="redis://:pw@ignored:1/3")
def test_sentinel_clients_find_the_master_through_the_sentinels(fresh_clients: None) -> None:
    sync = redis_conn.get_redis()
    pool = sync.connection_pool
    assert isinstance(pool, redis.sentinel.SentinelConnectionPool)
    assert pool.service_name == "igw"
    addrs = [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs[
        "port"]) for s in pool.sentinel_manager.sentinels]
    assert addrs == NODES
    # REDIS_URL gives the database and password, never the address.
    assert pool.connection_kwargs["db"] == 3 and pool.connection_kwargs["password"] == "pw"
    assert pool.connection_kwargs["retry"].get_retries() == 3
    async_pool = redis_conn._new_async_client().connection_pool
    assert isinstance(async_pool, aiosentinel.SentinelConnectionPool)
    assert async_pool.max_connections == redis_conn.ASYNC_MAX_CONNECTIONS
    relay = redis_conn.new_async_pool(client_name="relay")
    assert isinstance(relay, aiosentinel.SentinelConnectionPool)
    # Each follows a failover as connections are taken (ADR 0016), not only when it opens one.
    assert isinstance(pool, redis_conn._FollowingSentinelPool)
    assert isinstance(async_pool, redis_conn._AsyncFollowingSentinelPool)
    assert isinstance(relay, redis_conn._AsyncFollowingSentinelPool)


def test_a_master_move_seen_by_one_pool_makes_every_pool_ask_at_once(monkeypatch) -> None:
    """A process's pools move together: one admitting on the old master while another reads
    the new one loses requests in between (tests/test_faults_sentinel.py, failover)."""
    clock = [100.0]
    monkeypatch.setattr(redis_conn._MasterWatch, "moves", 0)
    a, b = redis_conn._MasterWatch(lambda: clock[0]), redis_conn._MasterWatch(lambda: clock[0])
    assert a.due() and b.due()  # the first look
    clock[0] += redis_conn.MASTER_CHECK_S / 2
    assert not a.due() and not b.due()  # within the period: no sentinel round trip
    a.saw(("10.0.0.1", 6379), ("10.0.0.2", 6379))  # a learned of a failover
    assert b.due() and not b.due()  # b asks at once, then waits its period again
    assert not a.due()  # a already knows
    a.saw(("10.0.0.2", 6379), ("10.0.0.2", 6379))  # no move: nobody is woken
    assert not b.due()
    clock[0] += redis_conn.MASTER_CHECK_S
    assert a.due() and b.due()  # the period


@override_settings(REDIS_SENTINEL_NODES=NODES, REDIS_SENTINEL_MASTER="igw", REDIS_URL="")
def test_sentinel_mode_never_starts_an_embedded_redis(fresh_clients: None) -> None:
    with pytest.raises(RuntimeError, match="REDIS_SENTINELS"):
        redis_conn.redis_url()


@override_settings(REDIS_SENTINEL_NODES=[], REDIS_URL="redis://127.0.0.1:6399/4")
def test_without_sentinels_the_url_is_used_as_before(fresh_clients: None) -> None:
    pool = redis_conn.get_redis().connection_pool
    assert type(pool) is redis.ConnectionPool
    assert (pool.connection_kwargs["host"], pool.connection_kwargs["port"],
            pool.connection_kwargs["db"]) == ("127.0.0.1", 6399, 4)
    async_pool = redis_conn._new_async_client().connection_pool
    # redis-py's blocking pool (packing with hiredis), not a Sentinel one.
    assert isinstance(async_pool, redis.asyncio.BlockingConnectionPool)
    assert not isinstance(async_pool, aiosentinel.SentinelConnectionPool)


@pytest.mark.integration
def test_celery_broker_goes_through_the_sentinels() -> None:
    """A message sent by the app's broker connection lands on the master the sentinels name."""
    group = SentinelGroup().start()
    try:
        script = (
            "import django; django.setup()\n"
            "from gateway.celery import app\n"
            "app.loader.import_default_modules()\n"
            "print(app.conf.broker_url)\n"
            "with app.connection_for_write() as conn:\n"
            "    q = conn.SimpleQueue('igw-sentinel-check')\n"
            "    q.put({'hello': 1})\n"
            "    q.close()\n")
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "gateway.settings", **group.env()}
        done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.startswith("sentinel://127.0.0.1:"), done.stdout
        assert group.master().llen("igw-sentinel-check") == 1
    finally:
        group.stop()
