"""Real Redis high availability for tests: a primary, a replica and three sentinels.

Every process is a ``redis-server`` on a free 127.0.0.1 port, without persistence, killed at
``stop()``. The sentinels get a generated config (they rewrite it, so each has its own file in a
temporary directory) and detect a dead primary after ``DOWN_AFTER_MS``.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.sentinel
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from tests import procs
from tests.redis_procs import RedisProcs

MASTER = "igw-ha"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


class SentinelGroup(RedisProcs):
    def __init__(self, n_sentinels: int = 3) -> None:
        super().__init__("igw-sentinel-")
        self.data_ports = [procs.free_port(), procs.free_port()]  # [primary, replica] at start
        self.sentinel_ports = [procs.free_port() for _ in range(n_sentinels)]

    @property
    def sentinels_setting(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)

    def env(self) -> dict[str, str]:
        """What a gateway or worker needs to find the master through the sentinels."""
        return {"REDIS_URL": "", "REDIS_SENTINELS": self.sentinels_setting,
                "REDIS_SENTINEL_MASTER": MASTER}

    def start(self) -> SentinelGroup:
        primary, replica = self.data_ports
        self.spawn(primary, primary)
        self.spawn(replica, replica, "--replicaof", "127.0.0.1", str(primary))
        procs.wait_until(lambda: self._info(replica).get("master_link_status") == "up", 15,
                         "the replica to sync")
        for port in self.sentinel_ports:
            conf = self.dir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndaemonize no\n"
                f"dir {self.dir}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
                f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {MASTER} 1\n")
            self.spawn(port, port, sentinel_conf=conf)
        procs.wait_until(self._sentinels_agree, 20, "the sentinels to find each other")
        return self

    def _info(self, port: int) -> dict[str, Any]:
        try:
            return dict(redis.Redis(port=port, socket_timeout=0.5).info("replication"))
        except redis.RedisError:
            return {}

    def _sentinels_agree(self) -> bool:
        n = len(self.sentinel_ports)
        for port in self.sentinel_ports:
            s = redis.Redis(port=port, socket_timeout=0.5, decode_responses=True)
            if (len(s.sentinel_sentinels(MASTER)) < n - 1
                    or not s.sentinel_slaves(MASTER)):
                return False
        return True

    def sentinel(self) -> redis.sentinel.Sentinel:
        return redis.sentinel.Sentinel([("127.0.0.1", p) for p in self.sentinel_ports],
                                       socket_timeout=0.5)

    def master(self) -> redis.Redis:
        """A client that follows the master across a failover (retries while it happens)."""
        return self.sentinel().master_for(
            MASTER, socket_timeout=2.0,
            retry=Retry(ExponentialWithJitterBackoff(base=0.1, cap=1.0), 10))

    def master_port(self) -> int:
        return int(self.sentinel().discover_master(MASTER)[1])

    def kill_master(self) -> int:
        """SIGKILL the current primary, as a lost machine; returns its port."""
        port = self.master_port()
        self.kill(port)
        return port

    def request_failover(self) -> int:
        """SENTINEL FAILOVER: the replica is promoted, the old primary lives on as its replica
        (clients still connected to it get READONLY on their next write); returns its port."""
        port = self.master_port()
        redis.Redis(port=self.sentinel_ports[0], socket_timeout=2).sentinel_failover(MASTER)
        return port

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Until the sentinels name a new primary that accepts writes; returns its port."""
        def promoted() -> bool:
            try:
                port = self.master_port()
            except redis.RedisError:
                return False
            return port != old_port and self._info(port).get("role") == "master"

        procs.wait_until(promoted, timeout, "a replica to be promoted", interval=0.1)
        return self.master_port()

