"""``manage.py serve``: the quick-start launcher (gateway + one pool worker per enabled pool).

Resolves Redis first (an empty REDIS_URL starts the embedded server) and hands its address to
every child, starts uvicorn on ``gateway.asgi:application``, one Celery worker hosting each
enabled pool's engine (``--engine-pool``) and Celery beat for the periodic tasks, then waits.
SIGINT/SIGTERM are forwarded to the children (workers drain: they finish running sequences).
Exits non-zero if a child dies during start-up, or when any child dies later.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from tenants.demo import try_it

STARTUP_TIMEOUT_S = 60.0
VLLM_STARTUP_TIMEOUT_S = 1800.0  # a vllm pool's worker loads the model first: minutes


class Command(BaseCommand):
    help = "Run the gateway (uvicorn) and one Celery worker per enabled pool, in the foreground."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--no-beat", action="store_true", help="Do not start Celery beat.")
        parser.add_argument(
            "--startup-timeout", type=float, default=None,
            help=f"seconds to wait for the gateway and every pool worker (default "
                 f"{STARTUP_TIMEOUT_S:g}, {VLLM_STARTUP_TIMEOUT_S:g} with a vllm pool enabled)")
        parser.add_argument(
            "--gateway-processes", type=int, default=1,
            help="uvicorn worker processes sharing the port; each relays its own streams with "
                 "one Redis reader (about one per core left over by Redis and the engines).")

    def handle(self, *args: Any, **options: Any) -> None:
        from gateway.redis_conn import redis_url
        from tenants.models import Pool

        env = {**os.environ, "REDIS_URL": redis_url(), "PYTHONUNBUFFERED": "1"}
        pools = list(Pool.objects.filter(enabled=True).values_list("name", flat=True))
        if options["startup_timeout"] is None:
            real = Pool.objects.filter(enabled=True, backend="vllm").exists()
            options["startup_timeout"] = VLLM_STARTUP_TIMEOUT_S if real else STARTUP_TIMEOUT_S
        children = self._start(env, pools, options)
        stopping = {"signal": 0}

        def forward(signum: int, _frame: object) -> None:
            stopping["signal"] = signum
            for _name, proc in children:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM if signum == signal.SIGTERM else signal.SIGINT)

        signal.signal(signal.SIGINT, forward)
        signal.signal(signal.SIGTERM, forward)
        try:
            self._wait_ready(children, options["host"], options["port"],
                             options["startup_timeout"], stopping)
        except CommandError:
            forward(signal.SIGTERM, None)
            self._reap(children)
            raise
        base = f"http://{options['host']}:{options['port']}"
        self.stdout.write(self.style.SUCCESS(
            f"Gateway on {base}  (admin: {base}/admin/, OpenAI API: {base}/v1/)\n"
            f"Redis: {env['REDIS_URL']}  pools: {', '.join(pools) or '(none enabled)'}\n"
            "Ctrl-C stops everything (workers finish their running sequences first).\n"
            + try_it(base) + "\n(export IGW_KEY=the demo key printed above, or a new one "
            "from `.venv/bin/python manage.py issue_key demo --name mine`)"))
        code = self._supervise(children, stopping)
        if code:
            raise CommandError(f"a child process exited with status {code}", returncode=code)

    def _start(self, env: dict[str, str], pools: list[str],
               options: dict[str, Any]) -> list[tuple[str, subprocess.Popen[bytes]]]:
        py = sys.executable
        children = [("gateway", subprocess.Popen(
            [py, "-m", "uvicorn", "gateway.asgi:application", "--host", options["host"],
             "--port", str(options["port"]),
             # Deadline on request headers (slow-loris): gateway/httpproto.py.
             "--http", "gateway.httpproto:BoundedHttpToolsProtocol",
             *performance_options(options["gateway_processes"])], env=env))]
        for pool in pools:
            children.append((f"worker[{pool}]", subprocess.Popen(
                [py, "-m", "celery", "-A", "gateway", "worker", "--engine-pool", pool,
                 "-P", "solo", "-c", "1", "-n", f"{pool}@%h", "-l",
                 settings.LOG_LEVEL.lower(), "--without-mingle", "--without-gossip"], env=env)))
        if not options["no_beat"]:
            schedule = settings.VAR_DIR / "celerybeat-schedule"
            settings.VAR_DIR.mkdir(parents=True, exist_ok=True)
            children.append(("beat", subprocess.Popen(
                [py, "-m", "celery", "-A", "gateway", "beat", "-s", str(schedule),
                 "-l", "warning"], env=env)))
        return children

    def _wait_ready(self, children: list[tuple[str, subprocess.Popen[bytes]]], host: str,
                    port: int, timeout: float, stopping: dict[str, int]) -> None:
        """The gateway port answers and every pool worker has registered in Redis."""
        deadline = time.monotonic() + timeout
        listening = False
        while time.monotonic() < deadline and not stopping["signal"]:
            for name, proc in children:
                if proc.poll() is not None:
                    raise CommandError(f"{name} exited with status {proc.returncode} at start-up",
                                       returncode=proc.returncode or 1)
            if not listening:
                with socket.socket() as sock:
                    sock.settimeout(0.5)
                    listening = sock.connect_ex((host, port)) == 0
            if listening and self._workers_registered(children):
                return
            time.sleep(0.2)
        if stopping["signal"]:
            return
        if not listening:
            raise CommandError(f"the gateway did not listen on {host}:{port} in {timeout:g}s")
        raise CommandError(f"the pool workers did not register in Redis in {timeout:g}s")

    def _workers_registered(self, children: list[tuple[str, subprocess.Popen[bytes]]]) -> bool:
        from gateway.redis_conn import get_redis, key

        r = get_redis()
        for name, _proc in children:
            if name.startswith("worker[") and not r.zcard(key("workers", name[7:-1])):
                return False
        return True

    def _supervise(self, children: list[tuple[str, subprocess.Popen[bytes]]],
                   stopping: dict[str, int]) -> int:
        while True:
            for name, proc in children:
                code = proc.poll()
                if code is not None and not stopping["signal"]:
                    self.stderr.write(f"{name} exited with status {code}; stopping the rest")
                    stopping["signal"] = signal.SIGTERM
                    for _n, other in children:
                        if other.poll() is None:
                            other.send_signal(signal.SIGTERM)
                    self._reap(children)
                    return code or 1
            if stopping["signal"]:
                self._reap(children)
                return 0
            time.sleep(0.2)

    def _reap(self, children: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
        for _name, proc in children:
            try:
                proc.wait(timeout=660)  # workers drain for at most DRAIN_TIMEOUT_S
            except subprocess.TimeoutExpired:
                proc.kill()


def performance_options(processes: int = 1) -> list[str]:
    """uvloop when installed (uvicorn's "auto" picks it too; naming it makes its absence
    visible): a process relaying thousands of SSE events per second spends most of its time in
    the event loop. More than one process shares the port, each with its own stream reader."""
    import importlib.util

    out = ["--loop", "uvloop"] if importlib.util.find_spec("uvloop") else []
    return out + (["--workers", str(processes)] if processes > 1 else [])
