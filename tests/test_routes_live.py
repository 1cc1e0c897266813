"""Routes, health and failover on real processes (issue 28): one gateway, two pools of one
simulated model each with its own worker, and two pools of another model, one of them an
OpenAI-compatible upstream (``tests/upstream_server.py``) that can be told to answer 503.

- SIGKILL one pool's worker under a steady streaming load: requests not yet streaming complete
  on the other pool with no client-visible error; those mid-stream end with the retryable
  ``worker_lost``; no request is settled or charged twice.
- The upstream answers 503: every request completes on the other pool; its breaker opens.
- A route (alias, weights, priorities), a request's ``fallbacks``, the served model named in
  the ``model`` field and the ``x-served-model`` header, and an at-once refusal naming the
  model when no pool has a live worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from django.conf import settings

from catalog.models import Pool, Route, RouteTarget
from gateway.inference import cache
from gateway.inference.pools import choose_pool, forget_catalog
from gateway.inference.routes import Router, forget_routes
from infra.redis_conn import get_redis
from serving import response_cache
from serving.health import breaker_key
from tests import faults, procs, rkeys
from tests.factories import make_key, make_model, make_tenant, open_quota

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

MODEL, UP_MODEL, LONELY = "sim-fo", "sim-fo-up", "sim-fo-lonely"
A, B, UP, UP_B, DEAD = "fo-a", "fo-b", "fo-up", "fo-up-b", "fo-dead"
SLOW = {"decode_tokens_per_s": 20.0, "pool_tokens_per_s": None}
ENV = {"WORKER_HEARTBEAT_SECONDS": "0.2", "WORKER_DEAD_AFTER_SECONDS": "1.5",
       "GATEWAY_HEARTBEAT_SECONDS": "0.2", "GATEWAY_DEAD_AFTER_SECONDS": "1.5",
       "BREAKER_FAILURES": "3", "BREAKER_COOLDOWN_SECONDS": "30", "ROUTE_RETRIES": "2",
       "SHED_QUEUE_FACTOR": "0"}
RUN = os.getpid()  # a killed worker's id is never reused (the janitor marks it reaped)
WORKERS = {A: f"fa-{RUN}", B: f"fb-{RUN}", UP: f"fu-{RUN}", UP_B: f"fub-{RUN}"}


def prepare(upstream_port: int) -> None:
    model, up_model = make_model(MODEL), make_model(UP_MODEL)
    Pool.objects.exclude(name__in=[*WORKERS, DEAD]).update(enabled=False)
    for name in (A, B):
        Pool.objects.update_or_create(name=name, defaults={
            "model": model, "backend_settings": SLOW, "max_sequences": 4, "enabled": True})
    Pool.objects.update_or_create(name=UP, defaults={
        "model": up_model, "backend": "openai_upstream", "max_sequences": 4, "enabled": True,
        "backend_settings": {"base_url": f"http://127.0.0.1:{upstream_port}/v1",
                             "dialect": "vllm"}})
    Pool.objects.update_or_create(name=UP_B, defaults={
        "model": up_model, "backend_settings": SLOW, "max_sequences": 4, "enabled": True})
    Pool.objects.update_or_create(name=DEAD, defaults={  # no worker is ever started for it
        "model": make_model(LONELY), "enabled": True})


@pytest.fixture(scope="module")
def system(django_db_setup, django_db_blocker) -> Iterator[dict[str, Any]]:
    up_port = procs.free_port()
    upstream = procs.Proc("upstream", [sys.executable, "-m", "tests.upstream_server", "--port",
                                       str(up_port), "--model", UP_MODEL, "--decode-tps", "20"],
                          procs.child_env())
    started: list[procs.Proc] = [upstream]
    try:
        procs.wait_for_http(f"http://127.0.0.1:{up_port}/health", upstream)
        get_redis().flushdb()  # this module's test Redis: no other run's workers or breakers
        with django_db_blocker.unblock():
            prepare(up_port)
        workers = {pool: procs.start_worker(pool, worker_id=wid, env=ENV)
                   for pool, wid in WORKERS.items()}
        started += workers.values()
        gateway, url = procs.start_uvicorn(env=ENV)
        started.append(gateway)
        for pool, wid in WORKERS.items():
            procs.wait_for_worker(get_redis(), pool, wid, workers[pool])
        procs.wait_for_http(url + "/healthz", gateway)
        yield {"url": url, "workers": workers, "gateway": gateway, "up_port": up_port,
               "upstream": f"http://127.0.0.1:{up_port}"}
    except BaseException:
        for proc in started:
            print(f"--- {proc.name}\n{proc.logs()[-3000:]}")
        raise
    finally:
        if os.environ.get("ROUTES_LIVE_LOGS"):
            print(started[-1].logs()[-6000:])
        for proc in reversed(started):
            proc.stop()


@pytest.fixture
def plain(system) -> str:
    prepare(system["up_port"])  # transactional tests empty the tables after each test
    _, key = make_key(make_tenant(**open_quota(ttft_s=20.0, total_s=60.0)))
    return key


def body(model: str, tokens: int) -> dict[str, Any]:
    return {"model": model, "max_tokens": tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "A story."}]}


def completion(o: faults.Outcome) -> int:
    return int((o.usage or {}).get("completion_tokens", -1))


def attempts(records: dict[str, dict[str, Any]], rid: str) -> list[dict[str, Any]]:
    """The usage records of one client request: its first attempt and its retries."""
    return [rec for key, rec in records.items() if key == rid or key.startswith(rid + "-")]


def running(pool: str) -> int:
    r = get_redis()
    return sum(r.scard(rkeys.inflight_key(pool, w.decode()))
               for w in r.zrange(rkeys.workers_key(pool), 0, -1))


def test_backlogged_tenants_3_1_1_over_two_pools_get_their_weighted_shares(system):
    """Fairness across pools (ADR 0024): three tenants with weights 3:1:1, each keeping 12
    streams open, routed over two pools of 4 slots each. Every tenant is backlogged in both
    pools, so each pool's WFQ serves them 3:1:1 and so do the two together."""
    prepare(system["up_port"])
    get_redis().delete(breaker_key(A), breaker_key(B))
    tenants = {name: make_tenant(weight=w, **open_quota(streams=50, ttft_s=60.0,
                                                        total_s=120.0))
               for name, w in (("heavy", 3.0), ("b", 1.0), ("c", 1.0))}
    keys = {name: make_key(t)[1] for name, t in tenants.items()}
    url = system["url"]
    warmup, window = 6.0, 24.0
    counts: Counter[str] = Counter()
    pools_used: dict[str, set[str]] = {name: set() for name in keys}

    async def stream(client: httpx.AsyncClient, name: str, t_from: float, t_to: float) -> None:
        """Requests back to back until t_to. Each one's tokens are counted pro rata of the
        part of its decode (first token to end, at a steady rate) inside the window: exact
        counts, whatever the relay batched into one chunk."""
        while time.monotonic() < t_to:
            first = end = None
            tokens = 0
            async with client.stream("POST", url + "/v1/chat/completions",
                                     json={**body(MODEL, 40), "stream": True,
                                           "stream_options": {"include_usage": True}},
                                     headers={"Authorization": f"Bearer {keys[name]}"}) as r:
                async for line in r.aiter_lines():
                    if first is None and '"content"' in line:
                        first = time.monotonic()
                    if line.startswith("data: {") and '"usage":{' in line:
                        tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                end = time.monotonic()
            if first is not None and end > first:
                inside = max(0.0, min(end, t_to) - max(first, t_from))
                counts[name] += tokens * inside / (end - first)

    async def main() -> None:
        start = time.monotonic()
        limits = httpx.Limits(max_connections=60, max_keepalive_connections=60)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            await asyncio.gather(*(stream(client, name, start + warmup, start + warmup + window)
                                   for name in keys for _ in range(12)))

    procs.arun(main())
    names = {t.pk: name for name, t in tenants.items()}
    for rec in faults.settled_records(get_redis()).values():
        if rec["tenant_id"] in names:
            pools_used[names[rec["tenant_id"]]].add(rec["pool"])
    assert all(used == {A, B} for used in pools_used.values()), pools_used  # spread over both
    total = sum(counts.values())
    shares = {name: counts[name] / total for name in keys}
    print(f"\nfairness over two pools: tokens {({n: round(v) for n, v in counts.items()})} shares "
          + ", ".join(f"{n} {v:.3f}" for n, v in shares.items()))
    # The bound is what whole slots allow: a pool hands out 4 slots of 2 s streams, so a
    # weight-1 tenant's share of slots (0.8 per pool) is met only on average, and at the
    # window's edges it may hold one stream more or less per pool: 2 x 40 tokens of its ~750,
    # about 10%. (5% failed here on a quiet machine with b 0.203 and c 0.187.) Unweighted or
    # unfair service is far outside it: equal shares would be 0.333 each.
    for name, target in (("heavy", 0.6), ("b", 0.2), ("c", 0.2)):
        assert abs(shares[name] / target - 1) <= 0.10, shares


def test_a_prompt_cache_key_keeps_landing_on_one_pool_and_keys_spread_over_both(
        system, plain):
    """``prompt_cache_key`` steering (``routes._rendezvous``) through the official client: a
    model served by pools A and B with no route; the same key lands on the same pool every
    time (where its prefix is cached), different keys land on both. Sequential requests, so
    neither pool is ever busier than the other and only the key decides. Before the worker
    kill below: it needs both pools' workers alive."""
    r = get_redis()
    r.delete(breaker_key(A), breaker_key(B))
    client = openai.OpenAI(base_url=system["url"] + "/v1", api_key=plain, max_retries=0)

    def pool_for(cache_key: str, stream: bool = False) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "A long shared prefix."}],
            max_tokens=2, prompt_cache_key=cache_key, stream=stream)
        if stream:
            assert [c for c in raw.parse()]  # read to the end: the request then settles
        rid = raw.headers["x-request-id"]
        return str(rkeys.wait_usage_record(r, rid)["pool"])

    keys = [f"conversation-{i}" for i in range(16)]
    first = {key: pool_for(key) for key in keys}
    # Different keys spread: all 16 on one pool by chance would be 2 in 65,536.
    assert set(first.values()) == {A, B}, first
    # The same key, again and streamed this time: the same pool, not a fresh draw.
    assert {key: pool_for(key, stream=True) for key in keys} == first
    assert {pool_for(keys[0]) for _ in range(3)} == {first[keys[0]]}


def idle_tenants_gone(r: Any, pool: str) -> bool:
    """No tenant enqueued on ``pool`` within the fairness window: a lone tenant then may take
    every slot (dispatch.lua S3), not its share beside earlier tests' tenants (S2)."""
    secs, micros = r.time()
    last = r.zrange(rkeys.pool_key("wfq", pool, "seen"), -1, -1, withscores=True)
    return not last or last[0][1] < secs + micros / 1e6 - settings.WFQ_ACTIVE_WINDOW_SECONDS


def test_a_killed_pool_worker_is_routed_around_before_the_first_token(system, plain):
    """The worker killed is that of the pool with requests queued at the moment (the router
    may queue the overflow on either pool, or first on one: CI saw A's queue stay empty for
    30 s while B's grew); the other pool serves the route test below."""
    url = system["url"]
    r = get_redis()
    killed: list[float] = []
    procs.wait_until(lambda: idle_tenants_gone(r, A) and idle_tenants_gone(r, B),
                     2 * settings.WFQ_ACTIVE_WINDOW_SECONDS + 5, "earlier tenants to go idle")
    seen: list[str] = []  # the last reads: in the message if the load never showed

    def busy_with_a_queue() -> str | None:
        state = {pool: (running(pool), r.hlen(rkeys.pool_key("wfq", pool, "items")))
                 for pool in (A, B)}
        seen[:] = [*seen[-4:], str(state)]
        if all(run >= 3 for run, _ in state.values()):
            return next((pool for pool, (_, queued) in state.items() if queued >= 1), None)
        return None

    def kill(_tasks: Any) -> None:
        # Both pools busy (4 slots each) and more queued behind one of them.
        try:
            victim = str(procs.wait_until(busy_with_a_queue, 30, "both pools busy, some queued"))
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last (running, queued) per pool: {seen}") from None
        system["alive"] = B if victim == A else A
        time.sleep(0.3)  # the running ones have sent tokens
        os.kill(system["workers"][victim].pid, signal.SIGKILL)
        killed.append(time.monotonic())

    outcomes, _ = faults.stream_many(url, plain, body(MODEL, 50), 14, during=kill, timeout=90)
    streaming = [o for o in outcomes if o.first_token is not None and o.first_token < killed[0]]
    later = [o for o in outcomes if o not in streaming]
    errors = Counter(o.error for o in outcomes if not o.ok)
    around = max((o.first_token or o.ended) - max(killed[0], o.started) for o in later)
    faults.table("failover: SIGKILL of one pool's only worker, 14 streams over two pools", [
        ("requests completed", f"{sum(o.ok for o in outcomes)} / {len(outcomes)}"),
        ("streaming at the kill", len(streaming)),
        ("client-visible errors before a token", sum(1 for o in outcomes
                                                     if not o.ok and o.tokens == 0)),
        ("mid-stream ends (retryable)", dict(errors)),
        ("time to route around the dead pool", f"{around:.2f} s (queued there -> first "
                                               "token elsewhere, worst)"),
    ])
    assert later, "some requests must have been queued at the kill"
    # Not yet streaming: completed (on the other pool), with no client-visible error.
    assert all(o.ok and completion(o) == 50 for o in later), [(o.error, o.usage) for o in later]
    # Mid-stream: completed (the other pool's) or ended with the retryable worker_lost.
    assert all(o.ok or (o.error == "worker_lost" and o.tokens > 0) for o in streaming)
    assert errors.get("worker_lost", 0) >= 1
    # Every attempt settled once; a request never generated twice.
    procs.wait_until(lambda: all(faults.terminal_entries(r, o.rid) or
                                 attempts(faults.settled_records(r), o.rid)
                                 for o in outcomes), 20, "all settled")
    records = faults.settled_records(r)  # asserts one record per attempt
    retried = 0
    for o in outcomes:
        tried = attempts(records, o.rid)
        assert tried, o.rid
        retried += len(tried) > 1
        served = [rec for rec in tried if rec["completion_tokens"] > 0]
        assert len(served) <= 1 or not o.ok, tried
        if o.ok:
            assert sum(rec["completion_tokens"] for rec in tried) == 50
    assert retried >= 1


def test_an_upstream_answering_503_is_retried_on_the_other_pool_and_its_breaker_opens(
        system, plain):
    url = system["url"]
    r = get_redis()
    r.delete(breaker_key(UP))
    httpx.post(system["upstream"] + "/debug/fail", json={"status": 503}).raise_for_status()
    try:
        outcomes, _ = faults.stream_many(url, plain, body(UP_MODEL, 10), 12, timeout=60)
        # The draw is random: keep sending (each must succeed) until BREAKER_FAILURES
        # consecutive failures opened the upstream's breaker; then none goes there.
        for _ in range(30):
            if r.hget(breaker_key(UP), "state") == b"open":
                break
            outcomes += faults.stream_many(url, plain, body(UP_MODEL, 10), 1, timeout=60)[0]
    finally:
        httpx.post(system["upstream"] + "/debug/fail", json={"status": 0})
    assert all(o.ok and completion(o) == 10 for o in outcomes), [o.error for o in outcomes]
    records = faults.settled_records(r)
    retried = [o for o in outcomes if len(attempts(records, o.rid)) > 1]
    faults.table(f"failover: the upstream pool answers 503, {len(outcomes)} streams", [
        ("requests completed", f"{sum(o.ok for o in outcomes)} / {len(outcomes)}"),
        ("client-visible errors", sum(not o.ok for o in outcomes)),
        ("requests retried on the other pool", len(retried)),
        ("attempts metered", sum(len(attempts(records, o.rid)) for o in outcomes)),
        ("worst time to first token",
         f"{max(o.first_token - o.started for o in outcomes if o.first_token):.2f} s"),
    ])
    assert retried, "some requests went to the failing upstream first"
    for o in outcomes:
        assert sum(rec["completion_tokens"] for rec in attempts(records, o.rid)) == 10
    state = {k.decode(): v.decode() for k, v in r.hgetall(breaker_key(UP)).items()}
    assert state.get("state") == "open" and state.get("reason") == "failures", state


def test_a_retried_request_keeps_its_idempotency_key_and_its_priority_order(system, plain):
    """A route tries its priority-0 target first; the upstream's 503 moves the request to the
    priority-1 target, invisibly; the Idempotency-Key then replays that one answer."""
    url, r = system["url"], get_redis()
    r.delete(breaker_key(UP), breaker_key(UP_B))
    route = Route.objects.create(name="up-first")
    RouteTarget.objects.create(route=route, pool=Pool.objects.get(name=UP), priority=0)
    RouteTarget.objects.create(route=route, pool=Pool.objects.get(name=UP_B), priority=1)
    time.sleep(2.1)  # the gateway's route table TTL
    headers = {"Authorization": f"Bearer {plain}", "Idempotency-Key": "retry-once-1"}
    payload = {"model": "up-first", "max_tokens": 5,
               "messages": [{"role": "user", "content": "Hi"}]}
    httpx.post(system["upstream"] + "/debug/fail", json={"status": 503}).raise_for_status()
    try:
        first = httpx.post(url + "/v1/chat/completions", json=payload, headers=headers,
                           timeout=60)
        again = httpx.post(url + "/v1/chat/completions", json=payload, headers=headers,
                           timeout=60)
    finally:
        httpx.post(system["upstream"] + "/debug/fail", json={"status": 0})
        route.delete()
    assert first.status_code == 200, first.text
    assert first.json()["model"] == UP_MODEL and first.headers["x-served-model"] == UP_MODEL
    assert again.headers.get("idempotent-replayed") == "true" and again.content == first.content
    tried = sorted(attempts(faults.settled_records(r), first.headers["x-request-id"]),
                   key=lambda t: t["admitted_at_ms"])
    assert [(t["pool"], t["status"], t["completion_tokens"]) for t in tried] == [
        (UP, "error", 0), (UP_B, "ok", 5)]


def test_a_model_whose_pools_have_no_live_worker_is_refused_at_once_naming_it(system, plain):
    started = time.monotonic()
    resp = faults.chat(system["url"], plain, model=LONELY)
    assert time.monotonic() - started < 3
    error = resp.json()["error"]
    assert resp.status_code == 503 and error["code"] == "model_not_served", error
    assert LONELY in error["message"]


def test_a_route_spreads_by_weight_and_names_the_model_that_served(system, plain):
    get_redis().delete(breaker_key(A), breaker_key(B))
    route = Route.objects.create(name="fast-chat")
    alive = system.get("alive", B)  # the pool whose worker the kill test spared
    RouteTarget.objects.create(route=route, pool=Pool.objects.get(name=alive), weight=1.0)
    try:
        time.sleep(2.1)  # the gateway's route table TTL
        client = openai.OpenAI(base_url=system["url"] + "/v1", api_key=plain, max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="fast-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        reply = raw.parse()
        assert reply.model == MODEL and raw.headers["x-served-model"] == MODEL
        stream = client.chat.completions.create(
            model="fast-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
            stream=True)
        assert {c.model for c in stream} == {MODEL}
    finally:
        route.delete()


def test_request_fallbacks_serve_when_the_model_cannot(system, plain):
    client = openai.OpenAI(base_url=system["url"] + "/v1", api_key=plain, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=LONELY, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        extra_body={"fallbacks": [UP_MODEL]})
    assert raw.parse().model == UP_MODEL and raw.headers["x-served-model"] == UP_MODEL
    bad = httpx.post(system["url"] + "/v1/chat/completions",
                     headers={"Authorization": f"Bearer {plain}"},
                     json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                           "fallbacks": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "fallbacks"



def test_routing_overhead_per_request_against_the_single_pool_choice(system, plain):
    """The router's choice (breakers + the tenant's expected wait: three pipelined round trips
    for two targets) against the choice it replaced (least-loaded pool: two round trips), in
    this process, same Redis, same pools, alternating blocks."""
    get_redis().delete(breaker_key(B), breaker_key(UP), breaker_key(UP_B))
    tenant = make_tenant()
    who = SimpleNamespace(tenant_id=tenant.pk, tenant_region="local",
                          allowed_model_names=frozenset())
    forget_catalog()
    forget_routes()

    async def timed(n: int) -> tuple[float, float]:
        router = base = 0.0
        for _ in range(n):
            t = time.perf_counter()
            await Router(UP_MODEL, who).pick()  # type: ignore[arg-type]
            router += time.perf_counter() - t
            t = time.perf_counter()
            await choose_pool(UP_MODEL, tenant.pk, "local", frozenset())
            base += time.perf_counter() - t
        return router / n, base / n

    procs.arun(timed(20))  # warm the caches
    router, base = procs.arun(timed(300))
    faults.table("routing overhead per request (two healthy targets, 300 each, same run)", [
        ("router (breakers + expected wait)", f"{router * 1e6:.0f} us"),
        ("baseline (least-loaded pool)", f"{base * 1e6:.0f} us"),
        ("overhead", f"{(router - base) * 1e6:+.0f} us per request"),
    ])
    assert router < 0.05


def cached_tenant(**fields: Any) -> str:
    tenant = make_tenant(**open_quota(ttft_s=20.0, total_s=60.0))
    tenant.response_cache = True
    tenant.save()
    return make_key(tenant, **fields)[1]


def sse_call(url: str, key: str, payload: dict[str, Any],
             mode: str | None = None) -> tuple[httpx.Response, list[dict[str, Any]], list[str]]:
    """One streamed request: its response, every data chunk, and the content deltas."""
    headers = {"Authorization": f"Bearer {key}"}
    if mode:
        headers["x-gateway-cache"] = mode
    with httpx.stream("POST", url + "/v1/chat/completions", headers=headers, timeout=60,
                      json={**payload, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    chunks = [json.loads(ln) for ln in lines if ln != "[DONE]"]
    assert lines[-1] == "[DONE]"
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks
              if c.get("choices") and c["choices"][0]["delta"].get("content")]
    return r, chunks, deltas


def test_the_response_cache_is_per_tenant_and_its_hits_are_metered(system):
    prepare(system["up_port"])
    url, r = system["url"], get_redis()
    payload = {"model": MODEL, "temperature": 0, "max_tokens": 8,
               "messages": [{"role": "user", "content": "Cache me if you can."}]}
    a, b = cached_tenant(), cached_tenant()
    first, chunks, deltas = sse_call(url, a, payload)
    assert first.headers["x-cache"] == "miss" and deltas
    hit, hit_chunks, hit_deltas = sse_call(url, a, payload)
    assert hit.headers["x-cache"] == "hit" and hit.headers["x-served-model"] == MODEL
    # The same SSE shape: role, the same deltas, finish, usage, [DONE].
    assert hit_deltas == deltas
    assert [sorted(c) for c in hit_chunks] == [sorted(c) for c in chunks]
    assert hit_chunks[-1]["usage"]["completion_tokens"] == chunks[-1]["usage"][
        "completion_tokens"]
    # Metered as a cache hit, once, under cache:{model} (priced by the operator's row).
    records = faults.settled_records(r)
    rec = records[hit.headers["x-request-id"]]
    assert rec["status"] == "cache_hit" and rec["model"] == f"cache:{MODEL}"
    assert rec["completion_tokens"] == chunks[-1]["usage"]["completion_tokens"]
    # I1: poison A's entry; A reads it back, B (same body, also opted in) never does.
    digest = cache.digest("chat", payload)
    tenant_a = records[first.headers["x-request-id"]]["tenant_id"]
    procs.arun(response_cache.put(tenant_a, digest, response_cache.Entry(
        MODEL, B, ["A-SECRET"], "stop", 5, 1)))
    assert sse_call(url, a, payload)[2] == ["A-SECRET"]
    other, _, other_deltas = sse_call(url, b, payload)
    assert other.headers["x-cache"] == "miss" and "A-SECRET" not in "".join(other_deltas)
    # Refresh runs the request and replaces the entry; bypass does not touch the cache.
    fresh = sse_call(url, a, payload, "refresh")
    assert fresh[0].headers["x-cache"] == "refresh" and fresh[2] == deltas
    assert sse_call(url, a, payload)[2] == deltas
    bypass = sse_call(url, a, payload, "bypass")
    assert "x-cache" not in bypass[0].headers
    assert faults.settled_records(r)[bypass[0].headers["x-request-id"]]["status"] == "ok"
    # Not deterministic: never cached. Not opted in: only with the request's header.
    sampled = sse_call(url, a, {**payload, "temperature": 0.7})
    assert "x-cache" not in sampled[0].headers
    _, plain_key = make_key(make_tenant(**open_quota()))
    assert "x-cache" not in sse_call(url, plain_key, payload)[0].headers
    assert sse_call(url, plain_key, payload, "use")[0].headers["x-cache"] == "miss"
    # A non-streamed hit answers the same text as JSON.
    whole = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {a}"},
                       json=payload, timeout=60)
    assert whole.headers["x-cache"] == "hit"
    assert whole.json()["choices"][0]["message"]["content"] == "".join(deltas)
