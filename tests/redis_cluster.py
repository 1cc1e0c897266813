"""A real Redis Cluster for tests: three primaries, no replicas, on free 127.0.0.1 ports.

Every node is a ``redis-server --cluster-enabled yes`` without persistence, killed at
``stop()``; the 16,384 slots are spread over them as ``redis-cli --cluster create`` would (no
redis-cli needed). A cluster has only db 0, so tests that share one keep apart by
``REDIS_KEY_PREFIX``.

``python -m tests.redis_cluster`` starts one and prints its ``REDIS_CLUSTER_NODES`` value (for
trying the gateway against a cluster by hand); Ctrl-C stops it.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import redis
import redis.cluster

from tests import procs
from tests.redis_procs import RedisProcs

NODE_TIMEOUT_MS = 2000


class RedisCluster(RedisProcs):
    def __init__(self, n_primaries: int = 3) -> None:
        super().__init__("igw-cluster-")
        self.ports = [procs.free_port() for _ in range(n_primaries)]
        self.bus_ports = [procs.free_port() for _ in range(n_primaries)]

    @property
    def nodes_setting(self) -> str:
        """The value of ``REDIS_CLUSTER_NODES``."""
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def env(self) -> dict[str, str]:
        """What a gateway or worker needs to use the cluster. REDIS_URL stays: it is Celery's
        broker, a plain Redis (ADR 0018)."""
        return {"REDIS_CLUSTER_NODES": self.nodes_setting}

    def start(self) -> RedisCluster:
        try:
            for port in self.ports:
                self._spawn(port)
        except BaseException:
            self.stop()
            raise
        self._assign_slots()
        procs.wait_until(self._ready, 30, "the cluster to cover every slot", interval=0.1)
        return self

    def _assign_slots(self) -> None:
        """What ``redis-cli --cluster create --cluster-replicas 0`` does, without needing
        redis-cli: split the 16,384 slots into even ranges, one per node, then introduce the
        nodes to each other (the cluster bus spreads the slot map)."""
        n = len(self.ports)
        for i, port in enumerate(self.ports):
            first, last = i * 16384 // n, (i + 1) * 16384 // n - 1
            redis.Redis(port=port).execute_command("CLUSTER ADDSLOTSRANGE", first, last)
        for port in self.ports[1:]:
            redis.Redis(port=port).execute_command("CLUSTER MEET", "127.0.0.1", self.ports[0],
                                                   self.bus_ports[0])

    def _spawn(self, port: int) -> None:
        self.spawn(port, port, "--cluster-enabled", "yes",
                   "--cluster-config-file", f"nodes-{port}.conf",
                   # The bus port defaults to port + 10000, past 65535 for a high free port.
                   "--cluster-port", str(self.bus_ports[self.ports.index(port)]),
                   "--cluster-node-timeout", str(NODE_TIMEOUT_MS))

    def _ready(self) -> bool:
        """Every node says the cluster is ok, and knows every other node."""
        for port in self.ports:
            try:
                info = redis.Redis(port=port, socket_timeout=0.5).cluster("info")
            except redis.RedisError:
                return False
            text = info if isinstance(info, str) else info.decode() if isinstance(
                info, bytes) else "\n".join(f"{k}:{v}" for k, v in dict(info).items())
            if "cluster_state:ok" not in text or f"cluster_known_nodes:{len(self.ports)}" \
                    not in text:
                return False
        return True

    def client(self, **options: Any) -> redis.cluster.RedisCluster:
        return redis.cluster.RedisCluster(host="127.0.0.1", port=self.ports[0], **options)

    def owner(self, key: str) -> int:
        """The port of the node that serves ``key``'s slot now."""
        node = self.client().get_node_from_key(key)
        return int(node.port)


def fresh_redis_clients() -> None:
    """Forget this process's Redis clients, so the next ones follow the current settings."""
    from infra import redis_conn
    from serving import wfq

    redis_conn.get_redis.cache_clear()
    redis_conn.redis_url.cache_clear()
    redis_conn.async_clients.clear()
    # Dispatchers made on a client: the sync shortcuts' cached one, each loop's async one.
    for cached in (getattr(wfq, "_default", None), getattr(wfq, "_async_wfqs", None)):
        for forget in ("cache_clear", "clear"):
            if hasattr(cached, forget):
                getattr(cached, forget)()


if __name__ == "__main__":
    # SIGTERM (kill, timeout) stops the nodes too: they run in sessions of their own.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    cluster = RedisCluster().start()
    print(f"REDIS_CLUSTER_NODES={cluster.nodes_setting}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
