"""Fault 4: the database is unavailable.

The gateway (and a usage writer run as its own process) reach PostgreSQL through a TCP proxy
the test cuts and restores; the shared server is never touched. While it is cut:

- inference keeps working for keys this gateway verified before, for ``AUTH_STALE_SECONDS``
  (bounded: a key last verified longer ago than that is refused with 503 ``auth_unavailable``,
  and so is a key never seen: fail closed); the pool table is routed from its cached copy;
- usage records stay in Redis (``usage:pending`` / ``usage:processing``) and the writer fails
  without dropping any; once the database is back, one flush writes every record exactly once;
- the admin and ``/healthz`` answer 503 saying the database is unavailable, not a 500.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
from django.db import connection

from catalog.models import Pool
from infra.redis_conn import get_redis
from metering.models import UsageRecord
from metering.writer import pending_key, processing_key
from tests import faults, procs
from tests.factories import make_key, make_model, make_tenant, open_quota

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

POOL, MODEL = "fault-db-pool", "sim-fault-db"
STALE_S = 6.0


def quota(**extra: Any) -> dict[str, Any]:
    return open_quota(streams=50, **extra)


chat = functools.partial(faults.chat, model=MODEL, max_tokens=8, timeout=15)


def flush_writer(env: dict[str, str]) -> tuple[int, str]:
    """One metering flush in its own process (its database is the proxy)."""
    code = ("import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', "
            "'gateway.settings'); django.setup(); from metering.writer import flush; "
            "print(flush())")
    done = subprocess.run([sys.executable, "-c", code], cwd=procs.ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    return done.returncode, (done.stdout + done.stderr)[-600:]


def admin_session(url: str) -> httpx.Client:
    """A staff user logged in to the admin (before the outage)."""
    from django.contrib.auth import get_user_model

    get_user_model().objects.create_superuser("ops", "ops@example.com", "pw-ops-123456")
    client = httpx.Client(base_url=url, timeout=15)
    client.get("/admin/login/")
    login = client.post("/admin/login/?next=/admin/", data={
        "username": "ops", "password": "pw-ops-123456", "next": "/admin/",
        "csrfmiddlewaretoken": client.cookies["csrftoken"]},
        headers={"Referer": url + "/admin/login/"})
    assert login.status_code in (200, 302) and "sessionid" in client.cookies, login.text[:500]
    assert client.get("/admin/tenants/tenant/").status_code == 200
    return client


def run_db_outage(redis_client: Any) -> dict[str, Any]:
    model = make_model(MODEL)
    Pool.objects.create(name=POOL, model=model, max_sequences=16, backend_settings={
        "decode_tokens_per_s": 200.0, "pool_tokens_per_s": None})
    tenant = make_tenant(**quota())
    _, warm = make_key(tenant)
    _, cold = make_key(tenant, name="never used before the outage")
    db = connection.settings_dict
    proxy = faults.TcpProxy(db["HOST"] or "127.0.0.1", int(db["PORT"] or 5432)).start()
    via_proxy = procs.child_env()["DATABASE_URL"].rsplit("@", 1)[0] + \
        f"@127.0.0.1:{proxy.port}/{db['NAME']}"
    env = {"DATABASE_URL": via_proxy, "AUTH_STALE_SECONDS": str(STALE_S),
           "WORKER_HEARTBEAT_SECONDS": "0.2", "WORKER_DEAD_AFTER_SECONDS": "5"}
    r = get_redis()
    worker = procs.start_worker(POOL, worker_id="fdb-1", env=env)
    gw, url = procs.start_uvicorn(env=env)
    out: dict[str, Any] = {}
    with procs.supervised(worker, gw, then=proxy.close):
        procs.wait_for_worker(r, POOL, "fdb-1", worker)
        procs.wait_for_http(url + "/healthz", gw)
        out["before"] = chat(url, warm).status_code
        admin_client = admin_session(url)
        proxy.cut()
        cut_at = time.monotonic()
        time.sleep(1.5)  # past AUTH_CACHE_SECONDS and the pool table's TTL: both need the DB
        during = [chat(url, warm) for _ in range(5)]
        out["during"] = [x.status_code for x in during]
        out["cold"] = (lambda x: (x.status_code, x.json()["error"]["code"]))(chat(url, cold))
        health = httpx.get(url + "/healthz", timeout=15)
        out["health"] = (health.status_code, health.json().get("database"))
        admin = admin_client.get("/admin/tenants/tenant/")
        out["admin"] = (admin.status_code, "database is unavailable" in admin.text)
        out["writer_during"] = flush_writer(procs.child_env(env))
        out["buffered"] = r.llen(pending_key(POOL)) + r.llen(processing_key(POOL))
        time.sleep(max(0.0, STALE_S + 0.5 - (time.monotonic() - cut_at)))
        late = chat(url, warm)
        out["after_bound"] = (late.status_code, late.json()["error"]["code"])
        proxy.restore()
        out["writer_after"] = flush_writer(procs.child_env(env))
        out["records_in_db"] = UsageRecord.objects.filter(tenant_id=tenant.pk).count()
        out["left_in_redis"] = r.llen(pending_key(POOL)) + r.llen(processing_key(POOL))
        out["recovered"] = chat(url, warm).status_code
        out["alive"] = gw.alive() and worker.alive()
        return out


def report(res: dict[str, Any]) -> str:
    return faults.table(f"database unavailable (AUTH_STALE_SECONDS={STALE_S:g})", [
        ("inference during outage (known key)", res["during"]),
        ("never-seen key during outage", res["cold"]),
        ("known key after the stale bound", res["after_bound"]),
        ("/healthz", res["health"]),
        ("admin page, logged in (status, explains)", res["admin"]),
        ("usage writer during outage (rc)", res["writer_during"][0]),
        ("records buffered in Redis", res["buffered"]),
        ("records in DB after it returned", res["records_in_db"]),
        ("left in Redis", res["left_in_redis"]),
    ])


def test_database_outage(redis_client) -> None:
    res = run_db_outage(redis_client)
    report(res)
    assert res["before"] == 200 and res["alive"]
    assert res["during"] == [200] * 5  # cached principal + cached pool table
    assert res["cold"] == (503, "auth_unavailable")  # fail closed
    assert res["after_bound"] == (503, "auth_unavailable")  # the bound holds
    assert res["health"][0] == 503 and res["health"][1].startswith("error")
    assert res["admin"] == (503, True)
    assert res["writer_during"][0] != 0  # it failed, and dropped nothing:
    assert res["buffered"] == 6  # 1 before + 5 during the outage
    assert res["writer_after"][0] == 0, res["writer_after"]
    assert res["records_in_db"] == 6 and res["left_in_redis"] == 0
    assert res["recovered"] == 200


def test_stale_principal_only_under_the_current_epoch(redis_client, monkeypatch) -> None:
    """Unit: the outage fallback keeps revocation (a revocation before the outage changed the
    epoch) and its bound; Redis unreadable as well means fail closed."""
    from django.db import OperationalError

    from tenants import auth

    auth.clear_cache()
    api_key, plain = make_key(make_tenant(**quota()))
    assert auth.authenticate(f"Bearer {plain}").key_id == api_key.pk

    def down(*_: Any) -> None:
        raise OperationalError("connection refused")

    monkeypatch.setattr(auth, "_load", down)
    monkeypatch.setattr(auth.settings, "AUTH_CACHE_SECONDS", 0.01)
    time.sleep(0.02)
    assert auth.authenticate(f"Bearer {plain}").key_id == api_key.pk  # stale, same epoch
    auth._publish_epoch()  # what a revocation does (the row change needs the DB up)
    with pytest.raises(auth.AuthError) as err:
        auth.authenticate(f"Bearer {plain}")
    assert err.value.status == 503 and err.value.code == "auth_unavailable"
