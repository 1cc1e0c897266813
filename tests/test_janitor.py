"""The janitor on real Redis: dead workers' requests end with a retryable error and are settled
once, overdue requests are expired, and any number of janitors can sweep at the same time."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from infra.redis_conn import key, new_redis, pool_key
from serving import admission as acc
from serving import janitor, transport, wfq, wire
from serving.admission import AdmissionLimits, ScopeLimits
from serving.keys import deadlines_key, inflight_key, req_key, stream_key, usage_pending_key
from serving.lua import script
from tests.procs import arun

# Run on one Redis and again on a real Redis Cluster (tests/conftest.py redis_topology): every
# script's keys must stay in one slot.
pytestmark = pytest.mark.redis_topologies("single", "cluster")

LIMITS = AdmissionLimits(tenant=ScopeLimits(input_tpm=100_000, output_tpm=100_000,
                                            concurrent_requests=100, open_streams=100),
                         total_deadline_s=60)


@pytest.fixture(autouse=True)
def _fast_death(settings):
    settings.WORKER_DEAD_AFTER_SECONDS = 2.0


def now(r: redis.Redis) -> float:
    secs, micros = r.time()
    return secs + micros / 1e6


def admission(rid: str, *, tenant: int = 1, out: int = 100,
              sampling: wire.SamplingParams | None = None) -> Any:
    """The admission (admit.lua, enter.lua) as the gateway makes it, to await; with
    ``sampling``, the request's payload in transit too (a prompt of three tokens), which a
    worker's dispatch claims."""
    payload = {} if sampling is None else {"prompt_ids": wire.pack_prompt([5, 6, 7]),
                                           "sampling": wire.pack_sampling(sampling)}
    return acc.admit_async(
        request_id=rid, tenant_id=tenant, key_id=tenant, pool="jp", model="m", prompt_tokens=10,
        max_output_tokens=out, stream=True, limits=LIMITS, extra={"weight": "1.0", **payload},
        queueing=acc.Queueing(kv_tokens=10 + out))


def admit(rid: str, *, tenant: int = 1, out: int = 100,
          sampling: wire.SamplingParams | None = None) -> None:
    """Admitted and queued in the WFQ, as the gateway does it (``admission``)."""
    assert isinstance(arun(admission(rid, tenant=tenant, out=out, sampling=sampling)),
                      acc.Admitted)


def admit_and_dispatch(r: redis.Redis, rid: str, worker: str, *, tenant: int = 1) -> None:
    """Admitted, then dispatched into ``worker``'s in-flight set and claimed, as a worker's
    dispatch loop does it (dispatch.lua K1)."""
    admit(rid, tenant=tenant)

    async def dispatch() -> list[wfq.DispatchedItem]:
        return await wfq.AsyncWfq().dispatch_many(
            "jp", n=1, free_slots=1, free_kv_tokens=10_000, worker_id=worker,
            claim=wire.PAYLOAD_FIELDS)

    [item] = arun(dispatch())
    assert item.request_id == rid and item.claimed


def deliver(r: redis.Redis, rid: str, tokens: int) -> None:
    """What a worker does before dying: stream ``tokens`` tokens."""
    for i in range(1, tokens + 1):  # the ids relay_step.lua gives (its D1)
        r.xadd(stream_key("jp", rid), {"t": "x", "n": 1}, id=f"{i}-{i}")


def register(r: redis.Redis, worker: str, *, age: float) -> None:
    r.zadd(pool_key("workers", "jp"), {worker: now(r) - age})
    r.sadd(key("pools"), "jp")


def last_entry(r: redis.Redis, rid: str) -> dict[bytes, bytes]:
    return r.xrevrange(stream_key("jp", rid), count=1)[0][1]


def records(r: redis.Redis) -> dict[str, dict]:
    return {x["request_id"]: x for x in map(json.loads, r.lrange(usage_pending_key("jp"), 0, -1))}


def test_dead_worker_requests_get_retryable_error_and_are_billed_for_delivered(redis_client):
    r = redis_client
    admit_and_dispatch(r, "running", "dead")
    deliver(r, "running", tokens=7)
    admit_and_dispatch(r, "silent", "dead", tenant=2)  # dispatched, died before its first token
    register(r, "dead", age=10)

    report = janitor.sweep()
    assert report.dead_workers == ["dead"]
    assert sorted(report.lost_requests) == ["running", "silent"]
    for rid in ("running", "silent"):
        entry = last_entry(r, rid)
        assert entry[b"e"] == b"worker_lost" and entry[b"r"] == b"1"
    got = records(r)
    assert got["running"]["completion_tokens"] == 7 and got["running"]["status"] == "error"
    assert got["silent"]["completion_tokens"] == 0
    assert r.zscore(pool_key("workers", "jp"), "dead") is None
    assert r.scard(inflight_key("jp", "dead")) == 0
    for pattern in ("conc:*", "streams:*"):
        assert all(int(r.get(k)) == 0 for k in r.keys(key(pattern)))
    # Sweeping again changes nothing.
    assert janitor.sweep().as_dict() == {"dead_workers": [], "lost_requests": [],
                                         "orphaned_requests": [], "expired_requests": []}
    assert r.llen(usage_pending_key("jp")) == 2


def test_a_live_worker_is_left_alone(redis_client):
    admit_and_dispatch(redis_client, "fine", "alive")
    register(redis_client, "alive", age=0.1)
    assert janitor.sweep().dead_workers == []
    assert redis_client.hget(req_key("jp", "fine"), "state") == b"running"
    assert redis_client.sismember(inflight_key("jp", "alive"), "fine")


def test_a_heartbeat_that_lands_before_the_reap_wins(redis_client):
    r = redis_client
    admit_and_dispatch(r, "saved", "slow")
    register(r, "slow", age=10)
    keys = [pool_key("workers", "jp"), pool_key("worker", "jp", "slow", "reaped"),
            pool_key("worker", "jp", "slow", "load")]
    assert script("heartbeat").run(r, keys, ["slow", "jp", 10]) == 1
    assert janitor.reap_worker(r, "jp", "slow", janitor.SweepReport()) is False
    assert r.hget(req_key("jp", "saved"), "state") == b"running"


def test_a_reaped_worker_never_beats_again_under_its_id(redis_client):
    r = redis_client
    register(r, "gone", age=10)
    janitor.sweep()
    keys = [pool_key("workers", "jp"), pool_key("worker", "jp", "gone", "reaped"),
            pool_key("worker", "jp", "gone", "load")]
    assert script("heartbeat").run(r, keys, ["gone", "jp", 10]) == 0
    assert r.zscore(pool_key("workers", "jp"), "gone") is None


def test_many_janitors_at_once_settle_each_request_once(redis_client):
    r = redis_client
    rids = [f"r{i}" for i in range(30)]
    for i, rid in enumerate(rids):
        admit_and_dispatch(r, rid, "dead", tenant=i % 3)
        deliver(r, rid, tokens=i % 4)
    register(r, "dead", age=10)
    barrier = threading.Barrier(6)

    def sweep(_: int) -> list[str]:
        client = new_redis()
        barrier.wait()
        return janitor.sweep(client).lost_requests

    with ThreadPoolExecutor(6) as pool:
        lost = [rid for batch in pool.map(sweep, range(6)) for rid in batch]
    assert sorted(lost) == sorted(rids)  # every request settled by exactly one janitor
    assert r.llen(usage_pending_key("jp")) == 30
    for i, rid in enumerate(rids):
        errors = [e for _, e in r.xrange(stream_key("jp", rid)) if b"e" in e]
        assert len(errors) == 1
        assert records(r)[rid]["completion_tokens"] == i % 4


def test_overdue_queued_request_is_expired_and_leaves_its_queue(redis_client):
    r = redis_client
    admit("late", out=50)
    assert [e.request_id for e in wfq.Wfq(r).queued_requests("jp")] == ["late"]
    deadline = r.zscore(deadlines_key("jp"), "late")
    assert janitor.settle_overdue(r, now=deadline - 1).expired_requests == []
    assert janitor.settle_overdue(r, now=deadline + 1).expired_requests == ["late"]
    assert wfq.Wfq(r).queued_requests("jp") == []
    entry = last_entry(r, "late")
    assert entry[b"e"] == b"deadline_exceeded" and entry[b"r"] == b"0"
    record = records(r)["late"]
    assert record["status"] == "expired" and record["prompt_tokens"] == 0
    assert r.zcard(deadlines_key("jp")) == 0


def test_overdue_running_request_is_settled_and_its_worker_told_to_abort(redis_client):
    r = redis_client
    admit_and_dispatch(r, "stuck", "w")
    deliver(r, "stuck", tokens=3)
    register(r, "w", age=0)
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(transport.cancel_channel("jp"))
    pubsub.get_message(timeout=1)
    deadline = r.zscore(deadlines_key("jp"), "stuck")
    assert janitor.settle_overdue(r, now=deadline + 1).expired_requests == ["stuck"]
    assert records(r)["stuck"]["completion_tokens"] == 3
    message = pubsub.get_message(timeout=2)
    assert message and message["data"] == b"stuck\tdeadline_exceeded"
    assert not r.sismember(inflight_key("jp", "w"), "stuck")
    pubsub.close()


def test_the_celery_task_runs_the_same_sweep(redis_client):
    from workers.tasks import janitor_sweep

    register(redis_client, "old", age=10)
    assert janitor_sweep() == {"dead_workers": ["old"], "lost_requests": [],
                               "orphaned_requests": [], "expired_requests": []}


def test_beat_sweeps_often_enough_to_end_lost_streams_soon_after_dead_after(settings):
    from gateway.celery import janitor_every_s

    settings.WORKER_HEARTBEAT_SECONDS, settings.WORKER_DEAD_AFTER_SECONDS = 1.0, 5.0
    assert janitor_every_s() == 2.5  # the default: a lost stream ends within 7.5 s
    settings.WORKER_HEARTBEAT_SECONDS, settings.WORKER_DEAD_AFTER_SECONDS = 0.2, 1.5
    assert janitor_every_s() == 0.75
    settings.WORKER_HEARTBEAT_SECONDS, settings.WORKER_DEAD_AFTER_SECONDS = 1.0, 60.0
    assert janitor_every_s() == 5.0  # never rarer than every 5 s
    settings.WORKER_HEARTBEAT_SECONDS, settings.WORKER_DEAD_AFTER_SECONDS = 2.0, 1.0
    assert janitor_every_s() == 2.0  # never more often than workers beat


def test_cancelling_a_running_request_flags_and_tells_its_workers_in_one_script(redis_client):
    """cancel.lua C1/C2: one call flags a dispatched request and publishes on its pool's
    cancel channel; a queued one is flagged only (the caller removes it), a settled one not."""
    from serving.submission import cancel_request

    r = redis_client
    admit_and_dispatch(r, "run", "w1")
    admit("wait")
    sub = r.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(transport.cancel_channel("jp"))
    sub.get_message(timeout=1.0)
    calls: list[str] = []
    real = script("cancel").run_async

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append("cancel")
        return await real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(script("cancel"), "run_async", counted)
        mp.setattr(transport, "publish_cancel", _no_publish)
        assert arun(cancel_request("jp", "run", "client_disconnect"))
    message = sub.get_message(timeout=2.0)
    assert message is not None and message["data"] == b"run\tclient_disconnect"
    assert calls == ["cancel"]  # nothing else sent for it
    assert r.hget(req_key("jp", "run"), "cancel") == b"client_disconnect"
    assert arun(cancel_request("jp", "wait", "client_disconnect"))  # queued: removed, settled
    assert r.hget(req_key("jp", "wait"), "state") == b"settled"
    assert sub.get_message(timeout=0.2) is None  # a queued request's workers are not told
    assert not arun(cancel_request("jp", "wait", "client_disconnect"))  # settled: nothing
    sub.close()


async def _no_publish(*_args: Any, **_kwargs: Any) -> int:
    raise AssertionError("the script publishes a running request's cancel itself")
