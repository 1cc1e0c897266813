"""``manage.py serve`` as a supervisor, on real processes, driven by real clients.

One serve (gateway, a good pool's worker, a pool whose configuration is wrong, the housekeeping
worker, beat) serves the first tests; each SIGKILLs one child while streams run and checks what
the clients saw, that the child came back and that a new request succeeds. The last tests run
their own: a gateway told to stop while streams are open, and Ctrl-C under load on the embedded
default (SQLite, embedded Redis) after which nothing serve started may remain.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import redis

from catalog import serve_status
from catalog.models import Pool
from gateway.inference import pools
from infra.redis_conn import get_redis
from tests import faults, procs, rkeys
from tests.factories import make_key, make_model, make_tenant, open_quota

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

GOOD, BAD, MODEL, BAD_MODEL = "sv-good", "sv-bad", "sim-sv", "sim-sv-bad"
DEAD_AFTER = 1.5
JANITOR_S = DEAD_AFTER / 2  # gateway.celery.janitor_every_s()
ENV = {
    "WORKER_HEARTBEAT_SECONDS": "0.2", "WORKER_DEAD_AFTER_SECONDS": str(DEAD_AFTER),
    "GATEWAY_HEARTBEAT_SECONDS": "0.2", "GATEWAY_DEAD_AFTER_SECONDS": str(DEAD_AFTER),
    "SSE_KEEPALIVE_SECONDS": "0.5", "WORKER_DRAIN_SECONDS": "1", "GATEWAY_SHUTDOWN_SECONDS": "2",
}
SLOW = {"decode_tokens_per_s": 20.0, "pool_tokens_per_s": None}  # streams last long enough
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "A long story."}],
        "max_tokens": 2000}
SHORT = {**LONG, "max_tokens": 5}


def quota(**extra: Any) -> dict[str, Any]:
    return open_quota(ttft_s=40.0, total_s=120.0, **extra)


def ensure_rows() -> None:
    """The pools serve runs (transactional tests empty the tables after each test)."""
    Pool.objects.exclude(name__in=[GOOD, BAD]).update(enabled=False)
    Pool.objects.get_or_create(name=GOOD, defaults={
        "model": make_model(MODEL), "backend_settings": SLOW, "max_sequences": 16})
    Pool.objects.get_or_create(name=BAD, defaults={
        "model": make_model(BAD_MODEL), "backend_settings": {"warp_drive": 9}})


def start_serve(port: int, env: dict[str, str], args: tuple[str, ...] = ()) -> procs.Proc:
    return procs.Proc(f"serve-{port}", [sys.executable, "manage.py", "serve", "--port", str(port),
                                        *args], env)


def child_pid(serve: procs.Proc, needle: str) -> int:
    """The pid of serve's direct child whose command line contains ``needle``."""
    for proc in psutil.Process(serve.pid).children():
        if needle in " ".join(proc.cmdline()):
            return proc.pid
    raise AssertionError(f"no child of serve runs {needle!r}")


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def worker_registered(pid: int) -> bool:
    return any(f"-{pid}-" in m.decode() for m in get_redis().zrange(rkeys.workers_key(GOOD), 0, -1))


def pool_worker_up(serve: procs.Proc) -> bool:
    """The good pool's worker is a child of serve and registered. False, not an error, while
    it is between restarts (serve retries a failing child every 30 s)."""
    try:
        return worker_registered(child_pid(serve, f"--engine-pool {GOOD}"))
    except (AssertionError, psutil.Error):
        return False


def restarted(serve: procs.Proc, needle: str, old: int, timeout: float = 60.0) -> int:
    def new_pid() -> int | None:
        try:
            pid = child_pid(serve, needle)
        except (AssertionError, psutil.Error):
            return None
        return pid if pid != old else None

    return procs.wait_until(new_pid, timeout, f"{needle} restarted", serve)  # type: ignore[return-value]


def client(url: str, plain: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=plain, max_retries=0, timeout=60)


def completes(url: str, plain: str) -> None:
    """A new streamed request succeeds, with the official client."""
    stream = client(url, plain).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True)
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason == "length"


def answered(url: str, plain: str, model: str) -> Any:
    """A short completion of ``model``, or None while the gateway does not know it (404)."""
    try:
        return client(url, plain).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    except openai.NotFoundError:
        return None


def served_now(url: str, plain: str) -> bool:
    """``completes``, or False while the pool has no live worker (503 model_not_served)."""
    try:
        completes(url, plain)
    except openai.InternalServerError as exc:
        if exc.status_code != 503 or "No worker is serving" not in str(exc):
            raise
        return False
    return True


def open_streams(url: str, plain: str, n: int, body: dict[str, Any],
                 action: Any) -> list[faults.Outcome]:
    """``n`` streams; ``action(outcomes_so_far)`` runs once each has its first token."""
    def when_started(tasks: list[Any]) -> Any:
        procs.wait_until(lambda: _all_started(url, n), 60, f"{n} streams running")
        time.sleep(1.0)  # each has sent its first tokens (and its request id) to the client
        return action()

    outcomes, _ = faults.stream_many(url, plain, body, n, during=when_started, timeout=90)
    return outcomes


def stream_once(url: str, plain: str, body: dict[str, Any]) -> faults.Outcome:
    """One stream, from a plain thread (``faults.stream_many`` owns an event loop)."""
    out = faults.Outcome(started=time.monotonic())
    with httpx.Client(timeout=90) as c, c.stream(
            "POST", url + "/v1/chat/completions", json={**body, "stream": True},
            headers={"Authorization": f"Bearer {plain}"}) as r:
        out.status, out.rid = r.status_code, r.headers.get("x-request-id")
        if r.status_code != 200:
            out.error = (json.loads(r.read() or b"{}").get("error") or {}).get("code")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                data = json.loads(line[6:])
                if "error" in data:
                    out.error = data["error"].get("code")
                for choice in data.get("choices") or []:
                    out.finish = choice.get("finish_reason") or out.finish
    out.ended = time.monotonic()
    return out


def _all_started(url: str, n: int) -> bool:
    r = get_redis()
    running = 0
    for wid in r.zrange(rkeys.workers_key(GOOD), 0, -1):
        running += r.scard(rkeys.inflight_key(GOOD, wid.decode()))
    return running >= n


def settled_once(rids: list[str], timeout: float) -> None:
    """Each request's stream got exactly one final entry (so it was settled exactly once)."""
    r = get_redis()
    procs.wait_until(lambda: all(faults.terminal_entries(r, rid) for rid in rids), timeout,
                     "every request settled")
    assert all(len(faults.terminal_entries(r, rid)) == 1 for rid in rids)


@pytest.fixture(scope="module")
def served(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[dict[str, Any]]:
    with django_db_blocker.unblock():
        ensure_rows()
        port = procs.free_port()
        env = procs.child_env({**ENV, "GATEWAY_VAR_DIR": str(tmp_path_factory.mktemp("var"))})
        serve = start_serve(port, env)
    url = f"http://127.0.0.1:{port}"
    try:
        procs.wait_for_http(url + "/healthz", serve, timeout=90)
        procs.wait_until(lambda: pool_worker_up(serve),
                         60, "the good pool's worker", serve)
        yield {"url": url, "serve": serve}
        serve.signal(signal.SIGTERM)
        assert serve.popen.wait(60) == 0, serve.logs()[-4000:]
    except BaseException:
        print(serve.logs()[-8000:])
        raise
    finally:
        serve.stop()


@pytest.fixture
def live(served) -> dict[str, Any]:
    ensure_rows()
    tenant = make_tenant(**quota())
    _, plain = make_key(tenant)
    serve = served["serve"]
    procs.wait_until(lambda: pool_worker_up(serve), 60,
                     "the good pool's worker", serve)
    return {**served, "plain": plain}


def test_a_pool_with_a_bad_configuration_is_reported_and_the_others_serve(live, client_admin):
    url, serve = live["url"], live["serve"]
    procs.wait_until(lambda: (serve_status.read(BAD) or {}).get("state") == "failing", 90,
                     "the bad pool reported failing", serve)
    record = serve_status.read(BAD)
    assert record["last_exit"] == "exit status 1" and "warp_drive" in record["output"]
    assert int(record["restarts"]) >= 2
    assert (serve_status.read(GOOD) or {}).get("state") == "running"
    log = serve.logs()
    assert re.search(r"worker\[sv-bad\] \(pid \d+\) exited unexpectedly: exit status 1", log)
    assert "worker[sv-bad] keeps exiting" in log
    pool = Pool.objects.get(name=BAD)
    page = client_admin.get(f"/admin/catalog/pool/{pool.pk}/change/").content.decode()
    assert "failing" in page and "warp_drive" in page and "keeps exiting" in page
    listing = client_admin.get("/admin/catalog/pool/").content.decode()
    assert "failing" in listing and "running" in listing
    completes(url, live["plain"])  # the good pool serves meanwhile
    assert serve.alive()


def test_a_killed_pool_worker_ends_its_streams_with_worker_lost_and_comes_back(live):
    url, serve, plain = live["url"], live["serve"], live["plain"]
    old = child_pid(serve, f"--engine-pool {GOOD}")
    killed: list[float] = []
    queued: list[faults.Outcome] = []
    # Sent while no worker runs: it waits in the queue for the restarted one.
    waiter = threading.Thread(target=lambda: queued.append(stream_once(url, plain, SHORT)))

    def kill() -> None:
        os.kill(old, signal.SIGKILL)
        killed.append(time.monotonic())
        # Its restarts fail too while the pool has a bad setting, so no pool worker's own
        # janitor runs: the lost streams must be ended by the housekeeping worker that serve
        # keeps running. (Set after the kill: serve restarts a running worker whose pool
        # changed, which would drain these streams instead of losing them.)
        Pool.objects.filter(name=GOOD).update(backend_settings={**SLOW, "warp_drive": 9})
        waiter.start()

    try:
        outcomes = open_streams(url, plain, 8, LONG, kill)
    finally:
        Pool.objects.filter(name=GOOD).update(backend_settings=SLOW)  # the fix, picked up
    assert [o.error for o in outcomes] == ["worker_lost"] * 8, [o.error for o in outcomes]
    bound = DEAD_AFTER + JANITOR_S + 3.0  # + slack for a loaded machine
    assert max(o.ended - killed[0] for o in outcomes) < bound
    new = restarted(serve, f"--engine-pool {GOOD}", old)
    procs.wait_until(lambda: pool_worker_up(serve), 90,
                     "a worker serving the pool again", serve)
    waiter.join(90)
    assert queued[0].ok, queued[0]
    # serve may restart the fixed worker once more: it compares the table with what it read
    # when it spawned the worker, and the fix can land between that and the worker's own read.
    procs.wait_until(lambda: served_now(url, plain), 60, "a new request served", serve)
    settled_once([o.rid for o in outcomes], 10)
    assert new != old
    log = serve.logs()
    assert f"worker[{GOOD}] (pid {old}) exited unexpectedly: killed by SIGKILL" in log
    # The housekeeping worker's janitor is the one that declared it dead.
    assert re.search(rf"housekeeping \| .*janitor: {{'dead_workers': \['{GOOD}-\S*-{old}-", log)


def test_a_killed_gateway_comes_back_and_its_requests_are_settled(live):
    url, serve, plain = live["url"], live["serve"], live["plain"]
    old = child_pid(serve, "uvicorn")
    killed: list[float] = []

    def kill() -> None:
        os.kill(old, signal.SIGKILL)
        killed.append(time.monotonic())

    outcomes = open_streams(url, plain, 4, LONG, kill)
    # The connections broke with the process: the clients know at once.
    assert all(o.error and o.error.startswith("transport:") for o in outcomes), outcomes
    assert max(o.ended - killed[0] for o in outcomes) < 3.0
    restarted(serve, "uvicorn", old)
    procs.wait_for_http(url + "/healthz", serve, timeout=60)
    completes(url, plain)
    # Nobody reads them any more: the janitor cancels them (gateway_lost) and they settle once.
    settled_once([o.rid for o in outcomes], DEAD_AFTER + JANITOR_S + 10)
    assert f"gateway (pid {old}) exited unexpectedly: killed by SIGKILL" in serve.logs()


def test_killed_beat_and_housekeeping_come_back_and_streams_are_unaffected(live):
    url, serve, plain = live["url"], live["serve"], live["plain"]
    beat, house = child_pid(serve, "gateway beat"), child_pid(serve, "housekeeping@")

    def kill() -> None:
        os.kill(beat, signal.SIGKILL)
        os.kill(house, signal.SIGKILL)

    outcomes = open_streams(url, plain, 3, {**LONG, "max_tokens": 40}, kill)
    assert all(o.ok for o in outcomes), outcomes
    restarted(serve, "gateway beat", beat)
    restarted(serve, "housekeeping@", house)
    completes(url, plain)
    log = serve.logs()
    assert f"beat (pid {beat}) exited unexpectedly: killed by SIGKILL" in log
    assert f"housekeeping (pid {house}) exited unexpectedly: killed by SIGKILL" in log


NEW, NEW_MODEL = "sv-new", "sim-sv-new"


def worker_up(serve: procs.Proc, pool: str) -> int | None:
    """The pid of serve's registered worker for ``pool``, or None."""
    try:
        pid = child_pid(serve, f"--engine-pool {pool}")
    except (AssertionError, psutil.Error):
        return None
    members = get_redis().zrange(rkeys.workers_key(pool), 0, -1)
    return pid if any(f"-{pid}-" in m.decode() for m in members) else None


def no_worker(serve: procs.Proc, pool: str, pid: int) -> bool:
    try:
        child_pid(serve, f"--engine-pool {pool}")
        return False
    except psutil.Error:  # a child went while we listed them: look again
        return False
    except AssertionError:
        try:
            return not alive(psutil.Process(pid))
        except psutil.Error:
            return True


def test_a_pool_added_disabled_and_re_enabled_while_serve_runs_is_started_and_stopped(live):
    """Issue 28: serve follows the pool table within seconds; the other pools never stop."""
    url, serve, plain = live["url"], live["serve"], live["plain"]
    good = child_pid(serve, f"--engine-pool {GOOD}")
    t0 = time.monotonic()
    Pool.objects.create(name=NEW, model=make_model(NEW_MODEL), max_sequences=8)
    try:
        pid = procs.wait_until(lambda: worker_up(serve, NEW), 40, "the added pool's worker",
                               serve)
        added_s = time.monotonic() - t0
        # The gateway reads the pool table at most every pools.TTL seconds: until then the new
        # model is unknown to it (404), however soon its worker is up.
        reply = procs.wait_until(lambda: answered(url, plain, NEW_MODEL), pools.TTL + 5,
                                 "the gateway to know the added model", serve)
        assert reply.choices[0].finish_reason == "length"
        t1 = time.monotonic()
        Pool.objects.filter(name=NEW).update(enabled=False)
        procs.wait_until(lambda: no_worker(serve, NEW, pid), 30, "the disabled pool's worker "
                         "stopped", serve)
        disabled_s = time.monotonic() - t1
        assert serve_status.read(NEW) is None
        t2 = time.monotonic()
        Pool.objects.filter(name=NEW).update(enabled=True)
        again = procs.wait_until(lambda: worker_up(serve, NEW), 40, "the re-enabled pool's "
                                 "worker", serve)
        enabled_s = time.monotonic() - t2
        assert again != pid
        # A change to what the worker reads at start restarts it with the new configuration.
        Pool.objects.filter(name=NEW).update(max_sequences=4)
        third = procs.wait_until(lambda: (p := worker_up(serve, NEW)) not in (None, again)
                                 and p, 40, "the changed pool's worker restarted", serve)
        assert third not in (pid, again)
        print(f"\nlifecycle: added -> serving {added_s:.1f} s, disabled -> stopped "
              f"{disabled_s:.1f} s, re-enabled -> serving {enabled_s:.1f} s")
        assert max(added_s, enabled_s) < 30 and disabled_s < 15
        assert child_pid(serve, f"--engine-pool {GOOD}") == good  # never touched
        log = serve.logs()
        assert f"pool {NEW} disabled; stopping its worker" in log
        assert f"pool {NEW} changed; stopping its worker" in log
        completes(url, plain)
    finally:
        Pool.objects.filter(name=NEW).update(enabled=False)


@pytest.fixture
def client_admin(client, django_user_model):
    admin = django_user_model.objects.create_superuser("sv-admin", "a@example.com", "x")
    client.force_login(admin)
    return client


# -- a gateway told to stop ends its open streams ----------------------------------------------


def test_a_stopping_gateway_ends_open_streams_with_a_retryable_error(redis_client) -> None:
    ensure_rows()
    tenant = make_tenant(**quota())
    _, plain = make_key(tenant)
    worker = procs.start_worker(GOOD, worker_id="sv-gw-w1", env=ENV)
    gateway, url = procs.start_uvicorn(env=ENV)
    try:
        procs.wait_for_worker(redis_client, GOOD, "sv-gw-w1", worker)
        procs.wait_for_http(url + "/healthz", gateway)
        stopped: list[float] = []
        waiting: list[faults.Outcome] = []

        def stop() -> None:
            # One more, for a pool whose only worker is wedged: queued, nothing sent yet.
            queued = threading.Thread(target=lambda: waiting.append(
                stream_once(url, plain, {**LONG, "model": BAD_MODEL})))
            queued.start()
            procs.wait_until(lambda: redis_client.hlen(rkeys.pool_key("wfq", BAD, "items")), 10,
                             "queued")
            gateway.signal(signal.SIGTERM)
            stopped.append(time.monotonic())
            queued.join(10)

        with procs.wedged_worker(BAD, "sv-bad-wedged"):
            procs.wait_for_worker(redis_client, BAD, "sv-bad-wedged", timeout=10)
            outcomes = open_streams(url, plain, 4, LONG, stop)
        # Without this, uvicorn would wait for 2000-token streams (100 s) to finish.
        assert [o.error for o in outcomes] == ["server_shutdown"] * 4, outcomes
        assert max(o.ended - stopped[0] for o in outcomes) < 3.0
        # Before its first byte, a request gets a 503 the official client retries.
        assert (waiting[0].status, waiting[0].error) == (503, "server_shutdown")
        assert waiting[0].ended - stopped[0] < 3.0
        # uvicorn re-raises the signal it caught once it has shut down (-15 is that, not a kill).
        assert gateway.popen.wait(10) in (0, -signal.SIGTERM)
        # Cancelled: the worker freed the slots, the queued one left its queue.
        settled_once([o.rid for o in [*outcomes, *waiting]], 10)
        procs.wait_until(lambda: not redis_client.scard(rkeys.inflight_key(GOOD, "sv-gw-w1")),
                         10, "the worker idle")
    except BaseException:
        print(gateway.logs()[-3000:], worker.logs()[-3000:])
        raise
    finally:
        gateway.stop()
        worker.stop()


# -- Ctrl-C on the embedded default -------------------------------------------------------------


def embedded_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL"}}
    return {**env, **ENV, "REDIS_URL": "", "DATABASE_URL": f"sqlite:///{tmp / 'gw.sqlite3'}",
            "GATEWAY_VAR_DIR": str(tmp / "var"), "PYTHONUNBUFFERED": "1", "LOG_LEVEL": "WARNING"}


def manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "manage.py", *args], cwd=procs.ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_ctrl_c_under_load_ends_every_stream_and_leaves_nothing_running(tmp_path) -> None:
    env = embedded_env(tmp_path)
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    manage(env, "migrate", "--noinput", "-v0")
    printed = manage(env, "bootstrap_demo", "--base-url", url)
    plain = re.search(r"\(shown once\): (\S+)", printed).group(1)
    manage(env, "shell", "-c", "from catalog.models import Pool; "
                              f"Pool.objects.update(backend_settings={SLOW!r})")
    serve = start_serve(port, env)
    try:
        procs.wait_for_http(url + "/healthz", serve, timeout=90)
        redis_port = int((tmp_path / "var" / "redis.port").read_text())
        # The embedded Redis is a supervised child too: killed, it comes back on its port.
        old_redis = child_pid(serve, "redis-server")
        os.kill(old_redis, signal.SIGKILL)
        restarted(serve, "redis-server", old_redis, timeout=20)
        body = {**LONG, "model": "sim-small"}
        procs.wait_until(lambda: serves(url, plain, {**body, "max_tokens": 3}), 60,
                         "a request served after the Redis restart", serve)
        everything = [psutil.Process(serve.pid), *descendants(serve.pid)]
        assert any("redis-server" in " ".join(p.cmdline()) for p in everything)
        stopped: list[float] = []

        def ctrl_c(_tasks: Any) -> None:
            procs.wait_until(lambda: _running(redis_port, "sim-local") >= 6, 60, "6 streams")
            time.sleep(1.0)
            everything.extend(p for p in descendants(serve.pid) if p not in everything)
            os.killpg(serve.pid, signal.SIGINT)  # the terminal's Ctrl-C: serve's group only
            stopped.append(time.monotonic())

        outcomes, _ = faults.stream_many(url, plain, body, 6, during=ctrl_c, timeout=60)
        # Each client got an error event it may retry (the drain ended its sequence), none hung.
        assert all(o.error in faults.RETRYABLE for o in outcomes), [o.error for o in outcomes]
        ended = max(o.ended - stopped[0] for o in outcomes)
        assert ended < 1 + 2 + 5
        assert serve.popen.wait(30) == 0, serve.logs()[-4000:]
        errors = sorted({str(o.error) for o in outcomes})
        print(f"Ctrl-C: streams ended within {ended:.2f} s, serve exited after "
              f"{time.monotonic() - stopped[0]:.2f} s; errors {errors}")
        procs.wait_until(lambda: not any(alive(p) for p in everything), 5,
                         "every process serve started to be gone")
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/healthz", timeout=1)
        assert not port_open(redis_port)
        assert not (tmp_path / "var" / "redis.port").exists()
        # Nor anything else that ran on this directory (a Redis an earlier command daemonized).
        assert not [p.info for p in psutil.process_iter(["pid", "cmdline"])
                    if str(tmp_path) in " ".join(p.info["cmdline"] or ())]
    except BaseException:
        print(serve.logs()[-6000:])
        raise
    finally:
        serve.stop()
        for p in descendants(serve.pid) if serve.alive() else []:
            p.kill()


def serves(url: str, plain: str, body: dict[str, Any]) -> bool:
    try:
        return stream_once(url, plain, body).finish == "length"
    except httpx.HTTPError:
        return False


def _running(redis_port: int, pool: str) -> int:
    """Sequences the embedded Redis shows running on the pool's workers."""
    r = redis.Redis(port=redis_port)
    return sum(r.scard(rkeys.inflight_key(pool, wid.decode()))
               for wid in r.zrange(rkeys.workers_key(pool), 0, -1))


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0
