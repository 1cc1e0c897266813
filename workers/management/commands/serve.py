"""``manage.py serve``: the one-command deployment, run under a supervisor.

Starts, each as a supervised child (``workers.supervisor``): the embedded Redis when
``REDIS_URL`` is empty, the gateway (uvicorn on ``gateway.asgi:application``), one Celery worker
hosting each enabled pool's engine (``--engine-pool``), a housekeeping Celery worker that runs
the periodic tasks (the janitor, usage flush, rollups, content-log drain) whether or not any
pool worker is alive, and Celery beat that schedules them.

A child that exits is restarted with backoff and its exit is logged (the pool's admin page
shows it too, ``catalog.serve_status``); one that keeps exiting is reported as failing and
retried, while the rest keep serving. Only Ctrl-C or SIGTERM stops everything, in order:
the pool workers drain (at most ``WORKER_DRAIN_SECONDS``), then the gateways end the streams
still open with a retryable error (at most ``GATEWAY_SHUTDOWN_SECONDS``), then beat and the
housekeeper, then Redis. A second Ctrl-C kills what is left at once. Why a supervisor of our own
and this order: docs/adr/0012-serve-supervisor.md.
Spend-alert webhooks run on their own Celery worker (queue ``webhooks``, threads), so a slow
receiver never holds the pool workers or the housekeeping tasks.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError, close_old_connections

from catalog import serve_status
from catalog.models import Pool
from infra import embedded_redis
from infra.pool_workers import workers_key
from infra.redis_conn import get_redis, redis_url
from infra.uvicorn_command import uvicorn_argv
from tenants.demo import try_it
from workers.supervisor import Child, ChildSpec, State, Supervisor

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 60.0
HOUSEKEEPING_STOP_S = 15.0
REDIS_STOP_S = 5.0
VLLM_STARTUP_TIMEOUT_S = 1800.0  # a vllm pool's worker loads the model first: minutes


class Command(BaseCommand):
    help = ("Run the gateway (uvicorn), one Celery worker per enabled pool, the housekeeping "
            "worker and beat, in the foreground, restarting any that exits.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-beat", action="store_true",
                            help="Do not start Celery beat (nor the housekeeping worker).")
        parser.add_argument(
            "--startup-timeout", type=float, default=None,
            help=f"seconds to wait for the gateway and every pool worker (default "
                 f"{STARTUP_TIMEOUT_S:g}, {VLLM_STARTUP_TIMEOUT_S:g} with a vllm pool enabled)")
        parser.add_argument(
            "--gateway-processes", type=int, default=1,
            help="uvicorn worker processes sharing the port; each relays its own streams with "
                 "one Redis reader (about one per core left over by Redis and the engines).")

    def handle(self, *args: Any, **options: Any) -> None:
        self.stop_signal = 0
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        with contextlib.ExitStack() as cleanup:
            url, redis_spec = self._redis(cleanup)
            self._run(url, redis_spec, options, cleanup)

    # -- Redis --------------------------------------------------------------------------------

    def _redis(self, cleanup: contextlib.ExitStack) -> tuple[str, ChildSpec | None]:
        """The Redis URL every child gets, and the embedded server's child when it is ours."""
        if settings.REDIS_URL or settings.REDIS_SENTINEL_NODES:  # Sentinel: never embedded
            return str(settings.REDIS_URL), None
        var = settings.VAR_DIR
        cleanup.enter_context(_exclusive(var / "serve.lock"))
        port = embedded_redis.take_over(var)
        url = f"redis://127.0.0.1:{port}/0"
        spec = ChildSpec("redis", embedded_redis.server_command(var, port, daemonize=False),
                         stop_timeout_s=REDIS_STOP_S,
                         ready=lambda _pid: embedded_redis.answers(url))
        cleanup.callback(embedded_redis.forget, var, port)
        return url, spec

    # -- the children -------------------------------------------------------------------------

    def _run(self, url: str, redis_spec: ChildSpec | None, options: dict[str, Any],
             cleanup: contextlib.ExitStack) -> None:
        env = {**os.environ, "REDIS_URL": url, "PYTHONUNBUFFERED": "1"}
        self.env = env
        self.pools = PoolWatch()
        self.pools.started = self.pools.read()
        pools = sorted(self.pools.started)
        if options["startup_timeout"] is None:  # a vllm pool's worker loads a model first
            real = Pool.objects.filter(enabled=True, backend="vllm").exists()
            options["startup_timeout"] = VLLM_STARTUP_TIMEOUT_S if real else STARTUP_TIMEOUT_S
        specs = ([redis_spec] if redis_spec else []) + self._specs(env, pools, options)
        self.sup = Supervisor(specs, listener=self._on_event)
        cleanup.callback(self._stop_all)
        if redis_spec is not None:
            self._start_redis(url)
            if self.stop_signal:
                return
        self.sup.start([s.name for s in specs if s is not redis_spec])
        self._wait_ready(options, pools)
        if self.stop_signal:
            return
        base = f"http://{options['host']}:{options['port']}"
        failing = [p for p in pools if self.sup.children[worker_name(p)].state is not State.RUNNING]
        self.stdout.write(self.style.SUCCESS(
            f"Gateway on {base}  (admin: {base}/admin/, OpenAI API: {base}/v1/)\n"
            f"Redis: {url}  pools: {', '.join(pools) or '(none enabled)'}\n"
            + (f"Not serving yet (see the log and the pool's admin page): {', '.join(failing)}\n"
               if failing else "")
            + "A child that exits is restarted. Ctrl-C stops everything (workers finish their "
            f"running sequences first, for at most {settings.WORKER_DRAIN_SECONDS:g} s).\n"
            + try_it(base) + "\n(export IGW_KEY=the demo key printed above, or a new one "
            "from `.venv/bin/python manage.py issue_key demo --name mine`)"))
        next_look = 0.0
        while not self.stop_signal:
            self.sup.poll()
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + settings.SERVE_POOL_POLL_SECONDS
                self._reconcile()
            time.sleep(0.1)

    def _reconcile(self) -> None:
        """Start, stop and restart pool workers to match the pool table (issue 28).

        A pool added or re-enabled gets its worker; a disabled or deleted one's worker drains
        and stops (``Supervisor.retire``); a pool whose configuration changed is retired and,
        once its old worker has exited, started again with the new one.
        """
        try:
            wanted = self.pools.read()
        except DatabaseError:  # the table is unreadable: keep what runs, look again later
            log.warning("serve: pool table unreadable; pool workers left as they are")
            close_old_connections()
            return
        running = {p: fp for p, fp in self.pools.started.items()
                   if worker_name(p) in self.sup.children}
        for pool, fp in running.items():
            child = self.sup.children[worker_name(pool)]
            if child.state is not State.RETIRING and wanted.get(pool) != fp:
                why = "disabled" if pool not in wanted else "changed"
                self.stderr.write(f"serve: pool {pool} {why}; stopping its worker")
                self.sup.retire(worker_name(pool))
                self.pools.started.pop(pool)
        for pool, fp in wanted.items():
            if pool not in self.pools.started and worker_name(pool) not in self.sup.children:
                self.stderr.write(f"serve: starting the worker of pool {pool}")
                self.sup.add(worker_spec(self.env, pool))
                self.pools.started[pool] = fp

    def _specs(self, env: dict[str, str], pools: list[str],
               options: dict[str, Any]) -> list[ChildSpec]:
        py, host, port = sys.executable, options["host"], options["port"]
        level = settings.LOG_LEVEL.lower()
        grace = math.ceil(settings.GATEWAY_SHUTDOWN_SECONDS)
        specs = [ChildSpec(
            "gateway",
            # The fixed options (--no-proxy-headers, the bounded protocol): infra.uvicorn_command.
            uvicorn_argv(py, ["--host", host, "--port", str(port),
                              "--timeout-graceful-shutdown", str(grace),
                              *performance_options(options["gateway_processes"])]),
            env=env, stop_timeout_s=grace + 5.0, ready=lambda _pid: _listening(host, port))]
        specs += [worker_spec(env, pool) for pool in pools]
        # Spend-alert webhooks on their own queue and threads: a slow receiver waits there, never
        # in the workers that run the engines and the back-office tasks.
        specs.append(ChildSpec(
            "webhooks",
            [py, "-m", "celery", "-A", "gateway", "worker", "-Q", "webhooks", "-P", "threads",
             "-c", "4", "-n", "webhooks@%h", "-l", level, "--without-mingle", "--without-gossip"],
            env=env, stop_timeout_s=HOUSEKEEPING_STOP_S))
        if not options["no_beat"]:
            # Beat only schedules; this worker (no engine) runs what it schedules even when
            # every pool worker is down, so lost streams still end (janitor) meanwhile.
            specs.append(ChildSpec(
                "housekeeping",
                [py, "-m", "celery", "-A", "gateway", "worker", "-P", "solo", "-c", "1",
                 "-n", "housekeeping@%h", "-l", level, "--without-mingle", "--without-gossip"],
                env=env, stop_timeout_s=HOUSEKEEPING_STOP_S))
            settings.VAR_DIR.mkdir(parents=True, exist_ok=True)
            specs.append(ChildSpec(
                "beat",
                [py, "-m", "celery", "-A", "gateway", "beat",
                 "-s", str(settings.VAR_DIR / "celerybeat-schedule"), "-l", "warning"],
                env=env, stop_timeout_s=HOUSEKEEPING_STOP_S))
        return specs

    def _start_redis(self, url: str) -> None:
        self.sup.start(["redis"])
        deadline = time.monotonic() + 15
        child = self.sup.children["redis"]
        while child.state is not State.RUNNING and not self.stop_signal:
            self.sup.poll()
            if time.monotonic() > deadline:
                raise CommandError(f"the embedded Redis did not start:\n{child.output()}")
            time.sleep(0.05)
        embedded_redis.record(settings.VAR_DIR, int(url.rsplit(":", 1)[1].split("/")[0]))
        # Resolved (and cached) now that the server answers: later calls must not find it
        # down during a restart and start a daemonized one of their own.
        if redis_url() != url:
            raise CommandError(f"the embedded Redis is not at {url}")

    def _wait_ready(self, options: dict[str, Any], pools: list[str]) -> None:
        """Until the gateway answers and each pool's worker registered or exited once.

        Only a gateway that never listens stops start-up (nothing could be served: a taken
        port, say); a pool whose worker cannot start is reported and retried, the others serve.
        """
        deadline = time.monotonic() + options["startup_timeout"]
        gateway = self.sup.children["gateway"]
        workers = [self.sup.children[worker_name(p)] for p in pools]
        while not self.stop_signal:
            self.sup.poll()
            settled = all(w.state is State.RUNNING or w.crashes for w in workers)
            if gateway.state is State.RUNNING and settled:
                return
            if time.monotonic() > deadline:
                if gateway.state is not State.RUNNING:
                    raise CommandError(
                        f"the gateway did not listen on {options['host']}:{options['port']} "
                        f"in {options['startup_timeout']:g}s ({gateway.last_exit or 'running'})"
                        f"; its last output:\n{gateway.output()}")
                return  # slow pool workers keep starting; the banner names them
            time.sleep(0.1)

    # -- events and stopping ------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        # Only flags here: the main thread may be inside a write to the same stream.
        if self.stop_signal and hasattr(self, "sup"):
            self.sup.hurry()  # a second Ctrl-C: kill what is left at once
        self.stop_signal = self.stop_signal or signum

    def _on_event(self, child: Child, event: str) -> None:
        pool = pool_of(child.name)
        if pool is None:
            return
        if event == "stopped":
            serve_status.clear(pool)
            return
        state = "failing" if child.failing else child.state.value
        serve_status.report(pool, state=state, pid=child.pid, last_exit=child.last_exit,
                            output=child.output(12) if child.last_exit else "",
                            restarts=max(0, child.starts - 1))

    def _stop_all(self) -> None:
        pools = [p for n in self.sup.children if (p := pool_of(n)) is not None]
        if self.stop_signal:
            self.stderr.write(f"{signal.Signals(self.stop_signal).name}: stopping everything "
                              "(press Ctrl-C again to kill it all at once)")
        self.sup.stop([
            [worker_name(p) for p in pools],  # drain first, while gateways still relay
            ["gateway"],  # then end what is still open, with a retryable error
            ["housekeeping", "webhooks", "beat"],
            ["redis"],
        ])
        self.stderr.write("serve: every child has stopped")


class PoolWatch:
    """The enabled pools and a fingerprint of what their worker reads at start-up."""

    FIELDS = ("backend", "backend_settings", "max_sequences", "kv_cache_tokens",
              "kv_overcommit", "model__name", "model__max_model_len", "model__tokenizer_path",
              "model__task", "dedicated_to_id", "region", "cell")

    def __init__(self) -> None:
        self.started: dict[str, str] = {}  # pool -> fingerprint its running worker started with

    def read(self) -> dict[str, str]:
        close_old_connections()
        rows = Pool.objects.filter(enabled=True).values("name", *self.FIELDS)
        return {row["name"]: hashlib.sha256(json.dumps(
            [row[f] for f in self.FIELDS], sort_keys=True, default=str).encode()).hexdigest()
            for row in rows}


def worker_spec(env: dict[str, str], pool: str) -> ChildSpec:
    """The Celery worker hosting ``pool``'s engine."""
    return ChildSpec(
        worker_name(pool),
        [sys.executable, "-m", "celery", "-A", "gateway", "worker", "--engine-pool", pool,
         "-P", "solo", "-c", "1", "-n", f"{pool}@%h", "-l", settings.LOG_LEVEL.lower(),
         "--without-mingle", "--without-gossip"],
        env=env, stop_timeout_s=settings.WORKER_DRAIN_SECONDS + 15.0, ready=_registered(pool))


def worker_name(pool: str) -> str:
    return f"worker[{pool}]"


def pool_of(name: str) -> str | None:
    return name[7:-1] if name.startswith("worker[") else None


def _listening(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _registered(pool: str) -> Callable[[int], bool]:
    """This process's engine host is in the pool's heartbeat set (ids embed the pid)."""
    def check(pid: int) -> bool:
        marker = f"-{pid}-"
        members: list[bytes] = get_redis().zrange(workers_key(pool), 0, -1)  # type: ignore[assignment]
        return any(marker in m.decode() for m in members)

    return check


@contextlib.contextmanager
def _exclusive(path: Any) -> Iterator[None]:
    """One serve per VAR_DIR: it owns that directory's embedded Redis."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CommandError(f"another `manage.py serve` is running with {path.parent}") from None
        yield


def performance_options(processes: int = 1) -> list[str]:
    """uvloop when installed (uvicorn's "auto" picks it too; naming it makes its absence
    visible): a process relaying thousands of SSE events per second spends most of its time in
    the event loop. More than one process shares the port, each with its own stream reader."""
    import importlib.util

    out = ["--loop", "uvloop"] if importlib.util.find_spec("uvloop") else []
    return out + (["--workers", str(processes)] if processes > 1 else [])
