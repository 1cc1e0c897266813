"""Fault 5: an engine that raises, stalls or returns garbage for one request fails that request
only, and deadlines fire.

Faults are injected through the pool's ``backend_settings["faults"]`` (an operator setting),
keyed on the request's sampling ``seed`` (``workers.engine.registry.fault_rules``). Healthy
requests run alongside the faulty ones on the same worker and must all complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from catalog.models import Pool
from infra.redis_conn import get_redis
from tests import faults, procs
from tests.factories import make_key, make_model, make_tenant, open_quota

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

POOL, MODEL = "fault-e-pool", "sim-fault-e"
ENV = {"WORKER_HEARTBEAT_SECONDS": "0.2", "WORKER_DEAD_AFTER_SECONDS": "5",
       "SSE_KEEPALIVE_SECONDS": "0.5"}
ERROR, GARBAGE, STALL = 6601, 6602, 6603
FAULTS = [
    {"seed": ERROR, "kind": "error", "after_tokens": 3},
    {"seed": GARBAGE, "kind": "invalid_tokens", "after_tokens": 4},
    {"seed": STALL, "kind": "stall", "after_tokens": 5, "seconds": 3.0},
]


def quota(**extra: Any) -> dict[str, Any]:
    return open_quota(**extra)


def run_engine_faults(redis_client: Any) -> dict[str, Any]:
    model = make_model(MODEL)
    Pool.objects.create(name=POOL, model=model, max_sequences=32, backend_settings={
        "decode_tokens_per_s": 100.0, "pool_tokens_per_s": None, "faults": FAULTS})
    healthy_t = make_tenant(**quota())
    faulty_t = make_tenant(**quota())
    hasty_t = make_tenant(**quota(ttft_deadline_s=1.0, total_deadline_s=2.0))
    tenants = [healthy_t, faulty_t, hasty_t]
    keys = {t.pk: make_key(t) for t in tenants}
    r = get_redis()
    worker = procs.start_worker(POOL, worker_id="fe-1", env=ENV)
    gw, url = procs.start_uvicorn(env=ENV)
    with procs.supervised(worker, gw, tail=3000):
        procs.wait_for_worker(r, POOL, "fe-1", worker)
        procs.wait_for_http(url + "/healthz", gw)
        msgs = [{"role": "user", "content": "Tell me something."}]

        progress = {"stall": faults.Outcome()}  # filled in as its tokens arrive

        def stall_began() -> None:
            def fifth_token_written() -> bool:
                rid = progress["stall"].rid
                return bool(progress["stall"].ended or (
                    rid and faults.stream_tokens(r, rid) >= 5))

            procs.wait_until(fifth_token_written, 30, "the stalling request's 5th token")

        def go(name: str, tenant: Any, seed: int | None, max_tokens: int,
               after: Callable[[], None] | None) -> faults.Outcome:
            if after is not None:
                after()
            body: dict[str, Any] = {"model": MODEL, "messages": msgs, "max_tokens": max_tokens}
            if seed is not None:
                body["seed"] = seed
            return faults.stream_one(url, keys[tenant.pk][1], body, progress.get(name))

        # "stall" hangs the whole engine for 3 s after its 5th token; "first_in_stall" is sent
        # once that 5th token is in the request's stream, so it arrives inside the stall however
        # late a loaded machine started "stall", and its first token comes after its 1 s TTFT
        # deadline (the stall has nearly 3 s left then).
        plan: list[tuple[str, Any, int | None, int, Callable[[], None] | None]] = [
            ("error", faulty_t, ERROR, 60, None), ("garbage", faulty_t, GARBAGE, 60, None),
            ("stall", hasty_t, STALL, 100, None),
            ("first_in_stall", hasty_t, None, 50, stall_began),
        ] + [(f"healthy{i}", healthy_t, None, 40, None) for i in range(12)]
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(plan)) as ex:
            futures = {name: ex.submit(go, name, t, seed, n, a) for name, t, seed, n, a in plan}
            outcomes = {name: f.result() for name, f in futures.items()}
        procs.wait_until(lambda: not faults.nonzero_counters(
            r, tenants, [k for k, _ in keys.values()]), 20, "counters back to zero")
        records = faults.settled_records(r)
        return {"outcomes": outcomes, "records": records, "elapsed": time.monotonic() - t0,
                "stream_tokens": {rid: faults.stream_tokens(r, rid) for rid in records},
                "worker_alive": worker.alive()}


def report(res: dict[str, Any]) -> str:
    rows = []
    for name, o in res["outcomes"].items():
        if name.startswith("healthy") and name != "healthy0":
            continue
        rec = res["records"].get(o.rid or "", {})
        rows.append((name, f"http {o.status} tokens {o.tokens} -> {o.error or o.finish}; "
                           f"billed {rec.get('completion_tokens')} ({rec.get('error_code')}) "
                           f"in {o.ended - o.started:.2f}s"))
    healthy = [o for n, o in res["outcomes"].items() if n.startswith("healthy")]
    rows.append(("healthy requests ok", f"{sum(o.ok for o in healthy)}/{len(healthy)}"))
    return faults.table("engine errors and slow engines (1 worker)", rows)


def test_engine_faults_fail_only_their_request(redis_client) -> None:
    res = run_engine_faults(redis_client)
    report(res)
    out, records = res["outcomes"], res["records"]
    assert res["worker_alive"]
    healthy = [o for n, o in out.items() if n.startswith("healthy")]
    assert all(o.ok and o.finish == "length" for o in healthy), [o.error for o in healthy]
    # Raised: a retryable engine_error after the tokens it had sent, billed for those only.
    assert out["error"].error == "engine_error" and out["error"].tokens >= 1
    # Garbage (ids outside the vocabulary): failed with the tokens before the garbage billed.
    assert out["garbage"].error == "engine_invalid_output"
    assert records[out["garbage"].rid]["error_code"] == "engine_invalid_output"
    # Stalls: the deadlines fire (TTFT before the first token, total after it).
    assert out["first_in_stall"].error == "ttft_deadline_exceeded"
    assert out["first_in_stall"].tokens == 0
    assert out["stall"].error == "deadline_exceeded"
    assert out["stall"].ended - out["stall"].started < 2.0 + 1.5
    for o in out.values():
        rec = records[o.rid]
        assert rec["completion_tokens"] == res["stream_tokens"][o.rid], rec
    assert records[out["garbage"].rid]["completion_tokens"] == 4


def test_fault_rules_are_checked_and_match_only_their_seed() -> None:
    from workers.engine.base import EngineRequest, SamplingParams
    from workers.engine.registry import EngineConfigError, EngineSpec, build_engine, fault_rules

    rules = fault_rules(FAULTS)

    def req(seed: int | None) -> EngineRequest:
        return EngineRequest(request_id="r", prompt_token_ids=[1, 2],
                             sampling=SamplingParams(max_tokens=4, seed=seed), cache_salt="")

    assert rules(req(ERROR)).kind == "error" and rules(req(STALL)).seconds == 3.0
    assert rules(req(None)) is None and rules(req(1)) is None
    for bad in ([{"kind": "error"}], [{"seed": 1, "kind": "explode"}], ["error"]):
        with pytest.raises(EngineConfigError):
            build_engine(EngineSpec(name="p", backend_settings={"faults": bad}))
