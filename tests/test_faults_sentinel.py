"""Redis failover under load: a primary, a replica and three sentinels (real ``redis-server``s).

The gateway and the pool worker reach Redis only through the sentinels (``REDIS_SENTINELS``).
The test SIGKILLs the primary while 30 streams run (or asks for a failover: the old primary is
demoted to a replica and answers READONLY); the sentinels promote the replica.
Chosen behaviour (docs/architecture.md "Failure modes", ADR "beyond-redis-sentinel"):

- while no master is known, admission fails closed (503, retryable); once the replica is
  promoted, admission works again against it without restarting anything;
- every stream in flight either completes (its state was replicated, the relay reconnects to
  the new primary and carries on) or ends with a retryable error, never a hang;
- no request is settled twice: settle is keyed by request state, so a repeated settle after the
  failover is refused, and the usage queue holds at most one record per request;
- counters and queues return to zero once everything has settled.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest

from catalog.models import Pool
from serving.settlement import Status, settle
from tests import faults, procs, rkeys
from tests.factories import make_key, make_model, make_tenant, open_quota
from tests.redis_ha import SentinelGroup

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

POOL, MODEL, WORKER = "ha-pool", "sim-ha", "ha-1"
STREAMS = 30


def quota(**extra: Any) -> dict[str, Any]:
    return open_quota(ttft_s=30.0, total_s=60.0, **extra)


chat = functools.partial(faults.chat, model=MODEL, max_tokens=5, timeout=10)


def run_failover(how: str) -> dict[str, Any]:
    Pool.objects.create(name=POOL, model=make_model(MODEL), max_sequences=40, backend_settings={
        "decode_tokens_per_s": 20.0, "pool_tokens_per_s": None})
    tenant = make_tenant(**quota())
    api_key, plain = make_key(tenant)
    group = SentinelGroup().start()
    r = group.master()
    env = {**group.env(), "WORKER_HEARTBEAT_SECONDS": "0.2", "WORKER_DEAD_AFTER_SECONDS": "3",
           "SSE_KEEPALIVE_SECONDS": "0.5"}
    worker = procs.start_worker(POOL, worker_id=WORKER, env=env)
    gw, url = procs.start_uvicorn(env=env)
    try:
        procs.wait_for_worker(r, POOL, WORKER, worker)
        procs.wait_for_http(url + "/healthz", gw)
        assert chat(url, plain).status_code == 200
        during: dict[str, Any] = {"statuses": []}

        def failover(_tasks: list[Any]) -> None:
            procs.wait_until(lambda: r.scard(rkeys.inflight_key(POOL, WORKER)) >= STREAMS,
                             20, "streams running")
            time.sleep(0.5)
            during["killed_at"] = time.monotonic()
            old = group.kill_master() if how == "kill" else group.request_failover()
            during["new_port"] = group.wait_failover(old)
            during["promoted_s"] = time.monotonic() - during["killed_at"]

            def served() -> bool:
                during["statuses"].append(chat(url, plain).status_code)
                return during["statuses"][-1] == 200

            procs.wait_until(served, 30, "admission after the failover", interval=0.2)
            during["admits_again_s"] = time.monotonic() - during["killed_at"]

        # ignore_eos: every stream runs 100 tokens (5 s), so all are mid-stream at the kill.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Long."}],
                "max_tokens": 100, "ignore_eos": True}
        outcomes, _ = faults.stream_many(url, plain, body, STREAMS, during=failover, timeout=90)
        after, _ = faults.stream_many(url, plain, {**body, "max_tokens": 20}, 10)
        procs.wait_until(lambda: not faults.nonzero_counters(r, [tenant], [api_key])
                         and not any(faults.pool_leftovers(r, POOL, [WORKER]).values()),
                         30, "counters and queues back to zero")
        records = faults.settled_records(r)  # asserts one record per request id
        # A late or repeated settle (a worker retrying after the failover) must not apply again.
        resettled = [o.rid for o in outcomes if o.rid and settle(
            POOL, o.rid, status=Status.ERROR, prompt_tokens=None, output_tokens=None,
            error_code="worker_lost", client=r)]
        return {"how": how, "outcomes": outcomes, "after": after, "during": during,
                "records": records,
                "records_after_resettle": len(faults.settled_records(r)),
                "resettled": resettled, "procs_alive": worker.alive() and gw.alive()}
    except BaseException:
        for p in (worker, gw):
            print(p.name, p.logs()[-4000:])
        print(group.logs())
        raise
    finally:
        for p in (gw, worker):
            p.stop()
        group.stop()


def report(res: dict[str, Any]) -> str:
    d, codes = res["during"], {}
    for o in res["outcomes"]:
        code = o.error or o.finish or "?"
        codes[code] = codes.get(code, 0) + 1
    ends = [o.ended - d["killed_at"] for o in res["outcomes"]]
    toks = [o.tokens for o in res["outcomes"]]
    title = {"kill": "primary SIGKILLed", "failover": "SENTINEL FAILOVER"}[res["how"]]
    return faults.table(f"Redis failover ({title}, replica promoted by Sentinel)", [
        ("streams in flight", len(res["outcomes"])),
        ("  how they ended", codes),
        ("  ended after kill p50/max (s)", f"{faults.pct(ends, 0.5):.2f} / {max(ends):.2f}"),
        ("  tokens received min/max", f"{min(toks)} / {max(toks)}"),
        ("  completed: usage.completion_tokens", sorted({(o.usage or {}).get(
            "completion_tokens") for o in res["outcomes"] if o.ok})),
        ("replica promoted after (s)", f"{d['promoted_s']:.2f}"),
        ("admission works again after (s)", f"{d['admits_again_s']:.2f}"),
        ("admission answers meanwhile", sorted(set(d["statuses"]))),
        ("streams after failover ok", f"{sum(o.ok for o in res['after'])}/{len(res['after'])}"),
        ("  content deltas / usage tokens", sorted({(o.tokens, (o.usage or {}).get(
            "completion_tokens")) for o in res["after"]})),
        ("usage records (one per request)", len(res["records"])),
    ])


@pytest.mark.parametrize("how", ["kill", "failover"])
def test_sentinel_failover_under_load(how: str) -> None:
    res = run_failover(how)
    report(res)
    d = res["during"]
    assert res["procs_alive"]
    # Admission came back against the new primary without a restart; meanwhile only 503s.
    assert d["admits_again_s"] < 30
    assert set(d["statuses"]) <= {200, 503}, d["statuses"]
    # Each stream in flight completed or ended retryably, soon after the kill.
    for o in res["outcomes"]:
        assert o.ok or o.error in faults.RETRYABLE | {"stream_broken"}, (o.error, o.finish)
        assert o.ended - d["killed_at"] < 15
    assert all(o.ok for o in res["after"]), [vars(o) for o in res["after"] if not o.ok]
    # Nothing settled twice: a second settle is refused and adds no usage record.
    assert res["resettled"] == []
    assert res["records_after_resettle"] == len(res["records"])
    # Every request that got an id and ended (ok or error) is settled exactly once.
    ended = {o.rid for o in res["outcomes"] + res["after"] if o.rid}
    assert ended <= set(res["records"]), ended - set(res["records"])
