"""Real subprocesses for integration tests: a uvicorn gateway, Celery pool workers.

Each process gets the test's database (the ``test_*`` one pytest-django created) and Redis in
its environment, writes its log to a file, and is killed at the end whatever happened. Use::

    with start_worker("pool-a", worker_id="w1") as worker:
        wait_for_worker(redis_client, "pool-a", "w1")
        ...
        worker.kill()           # SIGKILL, as a crashed machine
    print(worker.logs())        # on failure
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from infra.uvicorn_command import uvicorn_argv

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus the database and Redis the test is really using."""
    from django.conf import settings
    from django.db import connection

    from infra.redis_conn import redis_url

    db = connection.settings_dict
    env = dict(os.environ)
    if db["ENGINE"].endswith("postgresql"):
        auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
        env["DATABASE_URL"] = (
            f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
        )
    env["REDIS_URL"] = redis_url()
    env["REDIS_KEY_PREFIX"] = settings.REDIS_KEY_PREFIX
    # On a Redis Cluster (tests/conftest.py redis_topology) the children use it too; REDIS_URL
    # stays their Celery broker, a plain Redis (ADR 0018).
    env["REDIS_CLUSTER_NODES"] = ",".join(f"{h}:{p}" for h, p in settings.REDIS_CLUSTER_NODES)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class Proc:
    """A started child process with its log file."""

    def __init__(self, name: str, args: list[str], env: Mapping[str, str]) -> None:
        self.name = name
        self.log_path = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            args, cwd=ROOT, env=dict(env), stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: signals reach only it
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.alive():
            os.killpg(self.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash: no drain, no cleanup)."""
        self.signal(signal.SIGKILL)
        self.popen.wait(10)

    def terminate(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (warm shutdown), then SIGKILL after ``timeout``; returns the exit code."""
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def stop(self) -> None:
        if self.alive():
            self.terminate(10)
        self._log.close()

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def supervised(*procs: Proc, tail: int = 4000,
               then: Callable[[], object] | None = None) -> Iterator[None]:
    """Stop these processes however the block ends (last started, first stopped), and print
    the tail of each one's log when it fails, so pytest shows them beside the failure.
    ``then`` runs last: the proxy, Redis or sentinels the processes were using."""
    try:
        yield
    except BaseException:
        for proc in procs:
            print(f"--- {proc.name}\n{proc.logs()[-tail:]}")
        raise
    finally:
        for proc in reversed(procs):
            proc.stop()
        if then is not None:
            then()


def wait_until(check: Callable[[], object], timeout: float, what: str,
               proc: Proc | None = None, interval: float = 0.05) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc is not None and not proc.alive():
            raise AssertionError(f"{proc.name} exited ({proc.popen.returncode}) before {what}:\n"
                                 f"{proc.logs()[-4000:]}")
        time.sleep(interval)
    tail = f":\n{proc.logs()[-4000:]}" if proc is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{tail}")


def start_worker(pool: str, *, worker_id: str, env: Mapping[str, str] | None = None) -> Proc:
    """A Celery pool worker hosting ``pool``'s engine (``--engine-pool``)."""
    args = [
        sys.executable, "-m", "celery", "-A", "gateway", "worker", "--engine-pool", pool,
        "--engine-worker-id", worker_id, "-P", "solo", "-c", "1", "-l", "info",
        "-n", f"{worker_id}@%h", "--without-mingle", "--without-gossip", "--without-heartbeat",
    ]
    return Proc(f"worker-{worker_id}", args, child_env(env))


def wait_for_worker(client: object, pool: str, worker_id: str, proc: Proc | None = None,
                    timeout: float = 60.0) -> None:
    from serving.keys import workers_key

    wait_until(lambda: client.zscore(workers_key(pool), worker_id) is not None,  # type: ignore[attr-defined]
               timeout, f"worker {worker_id} to register", proc)


@contextlib.contextmanager
def wedged_worker(pool: str, worker_id: str, every: float = 0.1) -> Iterator[None]:
    """A worker that heartbeats and never takes work (a wedged engine host): the pool counts
    as served (``serving.availability``), so its requests are admitted and wait in its queue
    until their deadlines. A thread writes the heartbeat the way ``heartbeat.lua`` does."""
    import threading

    from infra.redis_conn import get_redis
    from serving.keys import workers_key

    stop = threading.Event()

    def beat() -> None:
        client = get_redis()
        while not stop.is_set():
            secs, micros = client.time()  # type: ignore[misc]
            client.zadd(workers_key(pool), {worker_id: secs + micros / 1e6})
            stop.wait(every)

    thread = threading.Thread(target=beat, name=f"wedged-{worker_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        get_redis().zrem(workers_key(pool), worker_id)


class Stack:
    """A gateway and its pool workers, started together (``stack``)."""

    def __init__(self, url: str, gateway: Proc, workers: dict[str, Proc]) -> None:
        self.url, self.gateway, self.workers = url, gateway, workers


@contextlib.contextmanager
def stack(workers: Mapping[str, str], env: Mapping[str, str] | None = None,
          timeout: float = 60.0, *, port: int | None = None,
          redis_client: Any = None) -> Iterator[Stack]:
    """Pool workers (``{worker id: pool}``) and a gateway (on ``port``, or a free one), yielded
    once every worker has registered (in ``redis_client``, the test's Redis by default) and the
    gateway answers; all stopped when the block ends, each one's log tail printed if it fails.
    The pools' rows must exist first (the workers read them at start)."""
    from infra.redis_conn import get_redis

    started = {wid: start_worker(pool, worker_id=wid, env=env) for wid, pool in workers.items()}
    gateway, url = start_uvicorn(port=port, env=env)
    with supervised(*started.values(), gateway):
        for wid, proc in started.items():
            wait_for_worker(redis_client or get_redis(), workers[wid], wid, proc, timeout)
        wait_for_http(url + "/healthz", gateway)
        yield Stack(url, gateway, started)


def start_uvicorn(
    *, port: int | None = None, env: Mapping[str, str] | None = None
) -> tuple[Proc, str]:
    """The ASGI gateway on a free port; returns (process, base URL)."""
    port = port or free_port()
    # The image's command line (infra.uvicorn_command: --no-proxy-headers, header deadline).
    args = uvicorn_argv(sys.executable, ["--host", "127.0.0.1", "--port", str(port),
                                         "--log-level", "warning"])
    return Proc(f"uvicorn-{port}", args, child_env(env)), f"http://127.0.0.1:{port}"


def wait_for_http(url: str, proc: Proc | None = None, timeout: float = 60.0) -> None:
    def answers() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                return resp.status < 500
        except OSError:
            return False

    wait_until(answers, timeout, f"{url} to answer", proc, interval=0.1)


def arun(coro: Any) -> Any:
    """``asyncio.run`` with fresh per-loop Redis clients.

    ``infra.redis_conn`` caches asyncio clients by ``id(loop)``; a new loop can reuse a closed
    loop's id and would be handed connections bound to the dead loop.
    """
    import asyncio

    from infra import redis_conn

    redis_conn.async_clients.clear()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            _cancel_leftovers(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_leftovers(loop: Any, timeout: float = 10.0) -> None:
    """Cancel the tasks a test left running, waiting at most ``timeout``.

    ``asyncio.run`` waits for them without a bound, so one task that does not end on
    cancellation turned a passed test into a pytest-timeout after 120 s with no clue which
    task it was. Here the stuck ones are named, with their stacks, and the test's own outcome
    stands.
    """
    import asyncio

    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    _done, stuck = loop.run_until_complete(asyncio.wait(pending, timeout=timeout))
    for task in stuck:
        print(f"arun: a task did not end within {timeout} s of its cancel: {task!r}")
        task.print_stack()


class Server:
    """A test's HTTP server process (an upstream engine, llama.cpp's server), up once ``probe``
    answers 200; its output goes to ``log``."""

    def __init__(self, args: list[str], url: str, probe: str, log: Path) -> None:
        import httpx

        self.url, self.log = url, log
        self._out = log.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # its log is read while it runs
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self._out, stderr=subprocess.STDOUT,
                                     env=env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{args[2]} exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + probe, timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{args[2]} did not start: {log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
