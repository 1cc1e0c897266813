"""One real ``redis-server`` per cell for tests (docs/adr/0019): no persistence, a free
127.0.0.1 port each, killed at ``stop()`` (or one at a time, as a lost cell)."""

from __future__ import annotations

import redis

from tests import procs
from tests.redis_procs import RedisProcs


class CellRedis(RedisProcs):
    def __init__(self, names: list[str]) -> None:
        super().__init__("igw-cells-")
        self.ports = {name: procs.free_port() for name in names}

    def start(self) -> CellRedis:
        for name, port in self.ports.items():
            self.spawn(name, port)
        return self

    def url(self, name: str) -> str:
        return f"redis://127.0.0.1:{self.ports[name]}/0"

    def client(self, name: str) -> redis.Redis:
        return redis.Redis(port=self.ports[name], socket_timeout=1, socket_connect_timeout=1)
