"""Fault 2: Redis restarts (empty: no persistence) under load.

The gateway and the worker use a private ``redis-server`` that the test kills and starts again
on the same port. Chosen behaviour while Redis is away (docs/architecture.md "Failure modes"):

- admission fails closed: every inference request gets 503 + Retry-After (nothing can be
  charged, so nothing is admitted; budgets are never bypassed); ``/healthz`` says ``redis:
  error``;
- streams in flight end with a retryable error (``service_unavailable`` after
  ``RELAY_OUTAGE_FAIL_S`` without Redis, or ``state_lost`` when Redis came back without their
  state), never a hang until their deadline;
- both processes reconnect by themselves; afterwards requests are served and the counters,
  queues and in-flight sets are consistent (back to zero once everything has settled).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import httpx
import pytest
import redis

from catalog.models import Pool
from infra.redis_conn import key
from serving.transport import RELAY_OUTAGE_FAIL_S
from tests import faults, procs, rkeys
from tests.factories import make_key, make_model, make_tenant, open_quota
from tests.redis_procs import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

POOL, MODEL = "fault-rd-pool", "sim-fault-rd"
OUTAGE_S = 4.0  # longer than RELAY_OUTAGE_FAIL_S: streams fail while Redis is away
SHORT_OUTAGE_S = 1.5  # shorter: they fail on reconnect, when their state is found gone


def quota(**extra: Any) -> dict[str, Any]:
    return open_quota(ttft_s=30.0, total_s=60.0, **extra)


chat = functools.partial(faults.chat, model=MODEL, max_tokens=5, timeout=10)


def run_redis_restart(redis_client: Any, outage_s: float = OUTAGE_S) -> dict[str, Any]:
    model = make_model(MODEL)
    Pool.objects.create(name=POOL, model=model, max_sequences=40, backend_settings={
        "decode_tokens_per_s": 20.0, "pool_tokens_per_s": None})
    tenant = make_tenant(**quota())
    api_key, plain = make_key(tenant)
    server = RedisServer()
    server.start()
    r = redis.Redis.from_url(server.url)
    env = {"REDIS_URL": server.url, "WORKER_HEARTBEAT_SECONDS": "0.2",
           "WORKER_DEAD_AFTER_SECONDS": "2", "SSE_KEEPALIVE_SECONDS": "0.5"}
    worker = procs.start_worker(POOL, worker_id="frd-1", env=env)
    gw, url = procs.start_uvicorn(env=env)
    with procs.supervised(worker, gw, then=server.stop):
        procs.wait_for_worker(r, POOL, "frd-1", worker)
        procs.wait_for_http(url + "/healthz", gw)
        assert chat(url, plain).status_code == 200
        during: dict[str, Any] = {}

        def outage(tasks: list[Any]) -> None:
            procs.wait_until(lambda: r.scard(rkeys.inflight_key(POOL, "frd-1")) >= 30, 20,
                             "streams running")
            time.sleep(0.5)
            during["killed_at"] = time.monotonic()
            server.stop()
            time.sleep(0.5)
            refused = chat(url, plain)
            during["admission"] = (refused.status_code, refused.headers.get("retry-after"),
                                   refused.json()["error"]["code"])
            health = httpx.get(url + "/healthz", timeout=10)
            during["health"] = (health.status_code, health.json().get("redis"))
            time.sleep(max(0.0, outage_s - (time.monotonic() - during["killed_at"])))
            server.start()
            during["restarted_at"] = time.monotonic()

        body = {"model": MODEL, "messages": [{"role": "user", "content": "Long."}],
                "max_tokens": 300}
        outcomes, _ = faults.stream_many(url, plain, body, 30, during=outage, timeout=90)
        # Reconnected without a restart: the worker re-registers, requests are served again.
        procs.wait_for_worker(r, POOL, "frd-1", worker, timeout=20)
        recovered: list[int] = []

        def served() -> bool:
            recovered.append(chat(url, plain).status_code)
            return recovered[-1] == 200

        procs.wait_until(served, 20, "a request served after the restart", interval=0.3)
        recovered_at = time.monotonic()
        after, _ = faults.stream_many(url, plain, {**body, "max_tokens": 20}, 10)
        procs.wait_until(lambda: not faults.nonzero_counters(r, [tenant], [api_key])
                         and not any(faults.pool_leftovers(r, POOL, ["frd-1"]).values()),
                         20, "counters and queues back to zero")
        no_ttl = [k for k in r.scan_iter(match=key("*"), count=1000) if r.ttl(k) == -1
                  and (b":stream:" in k or b":req:" in k)]
        return {"outage_s": outage_s, "outcomes": outcomes, "during": during,
                "recovered": recovered,
                "recovery_s": recovered_at - during["restarted_at"], "after": after,
                "leftovers": faults.pool_leftovers(r, POOL, ["frd-1"]),
                "counters": faults.nonzero_counters(r, [tenant], [api_key]),
                "keys_without_ttl": no_ttl, "procs_alive": worker.alive() and gw.alive(),
                "records_after": len(faults.settled_records(r))}


def report(res: dict[str, Any]) -> str:
    outs, d = res["outcomes"], res["during"]
    ends = [o.ended - d["killed_at"] for o in outs]
    codes: dict[str, int] = {}
    for o in outs:
        codes[o.error or o.finish or "?"] = codes.get(o.error or o.finish or "?", 0) + 1
    return faults.table(f"Redis restart ({res['outage_s']:g} s outage, data lost)", [
        ("streams in flight", len(outs)),
        ("  how they ended", codes),
        ("  ended after kill p50/max (s)", f"{faults.pct(ends, 0.5):.2f} / {max(ends):.2f}"),
        ("admission during outage", d["admission"]),
        ("/healthz during outage", d["health"]),
        ("first request served after restart (s)", f"{res['recovery_s']:.2f}"),
        ("streams after restart ok", f"{sum(o.ok for o in res['after'])}/{len(res['after'])}"),
        ("leftover counters / queues", f"{res['counters']} / {res['leftovers']}"),
        ("stream/req keys without TTL", len(res["keys_without_ttl"])),
    ])


@pytest.mark.parametrize("outage_s", [OUTAGE_S, SHORT_OUTAGE_S])
def test_redis_restart_under_load(redis_client, outage_s: float) -> None:
    res = run_redis_restart(redis_client, outage_s)
    report(res)
    d = res["during"]
    assert res["procs_alive"]
    # Fail closed while Redis is away, with a retryable status; health says what is wrong.
    assert d["admission"][0] == 503 and d["admission"][1] is not None
    assert d["health"][0] == 503 and d["health"][1].startswith("error")
    # In flight: a retryable error, soon after the outage began, never a hang.
    for o in res["outcomes"]:
        assert o.error in faults.RETRYABLE, (o.error, o.finish)
        assert o.ended - d["killed_at"] < outage_s + 5
    expected = "service_unavailable" if outage_s > RELAY_OUTAGE_FAIL_S else "state_lost"
    assert {o.error for o in res["outcomes"]} == {expected}
    # Back without restarting anything; consistent afterwards.
    assert all(o.ok for o in res["after"]), [str(vars(o)) for o in res["after"] if not o.ok]
    assert not res["counters"] and not any(res["leftovers"].values())
    assert not res["keys_without_ttl"], res["keys_without_ttl"][:5]
