"""One real ``redis-server`` per cell for tests (docs/adr/0019): no persistence, a free
127.0.0.1 port each, killed at ``stop()`` (or one at a time, as a lost cell)."""

from __future__ import annotations

import signal
import subprocess

import redis

from tests import procs
from tests.redis_procs import RedisProcs


class CellRedis(RedisProcs):
    def __init__(self, names: list[str]) -> None:
        super().__init__("igw-cells-")
        self.ports = {name: procs.free_port() for name in names}

    def start(self) -> CellRedis:
        for name, port in self.ports.items():
            log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115  (closed with the process)
            self.procs[name] = subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--daemonize", "no", "--dir", str(self.dir)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            procs.wait_until(lambda p=port: self._ping(p), 10, f"redis of cell {name}")
        return self

    def url(self, name: str) -> str:
        return f"redis://127.0.0.1:{self.ports[name]}/0"

    def client(self, name: str) -> redis.Redis:
        return redis.Redis(port=self.ports[name], socket_timeout=1, socket_connect_timeout=1)

    def kill(self, name: str) -> None:
        """SIGKILL one cell's Redis, as a lost machine."""
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

