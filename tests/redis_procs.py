"""The one place tests and benches start a ``redis-server``.

Every test-started server runs without persistence on 127.0.0.1, in a session of its own (so a
test's Ctrl-C reaches it only through ``stop()``), and logs to a scratch directory that
``stop()`` removes. ``RedisProcs`` is a group of them (cells, a cluster, a sentinel group: they
pass the extra arguments of their kind); ``RedisServer`` is one private server on a fixed port
that a test can stop and start again (the Redis-restart fault, the Redis-cost bench).

No Django here: a bench imports this before it configures Django.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import redis

from tests import procs


def data_args(port: int, directory: Path) -> list[str]:
    """A data server's arguments: its port, loopback only, nothing written to disk but what a
    replica's full sync needs (``--dir``: it writes an RDB file there whatever ``--save`` says)."""
    return ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--dir", str(directory)]


class RedisProcs:
    """A group of ``redis-server`` processes keyed by name, sharing one scratch directory."""

    def __init__(self, prefix: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.procs: dict[Any, subprocess.Popen[bytes]] = {}

    def spawn(self, name: Any, port: int, *extra: str, sentinel_conf: Path | None = None,
              ready_s: float = 10) -> None:
        """Start one server (a data server, or a sentinel from ``sentinel_conf``) and return
        once it answers PING."""
        argv = ([str(sentinel_conf), "--sentinel"] if sentinel_conf is not None
                else [*data_args(port, self.dir), *extra])
        log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115  (closed with the process)
        self.procs[name] = subprocess.Popen(["redis-server", *argv], stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        procs.wait_until(lambda: self._ping(port), ready_s, f"redis {name} on {port}")

    def kill(self, name: Any) -> None:
        """SIGKILL one server, as a lost machine."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def _ping(self, port: int) -> bool:
        try:
            return bool(redis.Redis(port=port, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}"
                         for p in sorted(self.dir.glob("*.log")))

    def stop(self) -> None:
        for name in list(self.procs):
            self.kill(name)
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisServer(RedisProcs):
    """One private server on a port of its own: ``start()`` and ``stop()`` it at will (it comes
    back empty, on the same port)."""

    def __init__(self, prefix: str = "igw-redis-") -> None:
        super().__init__(prefix)
        self.port = procs.free_port()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.dir.mkdir(exist_ok=True)  # stop() removed it
        self.spawn("redis", self.port)
        return self
