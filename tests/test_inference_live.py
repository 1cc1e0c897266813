"""The inference API against the running system: uvicorn, a Celery pool worker with the simulated
engine, real Redis and PostgreSQL, driven by the official ``openai`` client and raw HTTP.

One worker and one gateway serve the whole module (starting them costs seconds); each test makes
its own tenant and key, so tests share nothing but the processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from catalog.models import Pool
from infra.redis_conn import key
from serving.tokenization import load_tokenizer
from tests import faults, procs, rkeys
from tests.factories import make_key, make_model, make_tenant
from tests.live_pool import (
    HELLO,
    IDLE_MODEL,
    IDLE_POOL,
    IDLE_WORKER,
    MAX_BYTES,
    MODEL,
    POOL,
    SERVER_ENV,
    client,
    counters,
    ensure_pools,
    listed_models,
    rid_of,
    sse_events,
    tenant_key,
)
from tests.prom import value

# Every test here runs on one Redis; those marked so run again on a Redis Cluster
# (tests/conftest.py redis_topology), the gateway and worker processes with it.
pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True),
              pytest.mark.redis_topologies("single")]

@pytest.fixture(scope="module")
def system(live_system) -> Iterator[dict[str, Any]]:
    with procs.wedged_worker(IDLE_POOL, IDLE_WORKER):
        yield live_system(pool=POOL, worker_ids=["live-w1"], env=SERVER_ENV,
                          prepare=ensure_pools)


@pytest.fixture
def live(system, redis_client) -> dict[str, Any]:
    ensure_pools()
    # The flush removed the workers' registrations; wait for their next heartbeats.
    procs.wait_for_worker(redis_client, POOL, "live-w1", system["worker"], timeout=10)
    procs.wait_for_worker(redis_client, IDLE_POOL, IDLE_WORKER, timeout=10)
    # The tables were emptied and refilled: wait until the gateway's catalog (read at most every
    # couple of seconds) serves both models again, or a test would meet a stale 404.
    _, plain = tenant_key()
    procs.wait_until(lambda: {MODEL, IDLE_MODEL} <= listed_models(system["url"], plain), 15,
                     "the gateway's catalog to list the refilled models")
    return system


def bucket_level(redis_client, scope: str, ident: object, kind: str) -> float | None:
    level = redis_client.hget(rkeys.bucket_key(ident, scope, ident, kind), "level")
    return None if level is None else float(level)


def prompt_len(messages: list[dict[str, str]]) -> int:
    return len(load_tokenizer(None).apply_chat_template(messages))


# -- the official client, sync and async, streaming and not ----------------------------------


@pytest.mark.redis_topologies("single", "cluster")
def test_sync_chat_completion_counts_match_the_engine(live, redis_client) -> None:
    api_key, plain = tenant_key()
    raw = client(live["url"], plain).chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=7)
    reply = raw.parse()
    assert raw.headers["x-request-id"] == rid_of(reply.id)
    assert int(raw.headers["x-ratelimit-limit-requests"]) == 32
    assert reply.object == "chat.completion" and reply.model == MODEL
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert choice.message.content
    assert reply.usage.completion_tokens == 7
    assert reply.usage.prompt_tokens == prompt_len(HELLO)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 7
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    record = rkeys.wait_usage_record(redis_client, rid_of(reply.id))
    assert (record["prompt_tokens"], record["completion_tokens"]) == (prompt_len(HELLO), 7)
    assert (record["tenant_id"], record["key_id"], record["status"]) == (
        api_key.tenant_id, api_key.pk, "ok")
    # The completion text decodes to exactly the billed number of tokens.
    assert len(load_tokenizer(None).encode(choice.message.content)) <= 7
    procs.wait_until(lambda: counters(redis_client, api_key)["conc_t"] == 0, 5, "slot back")


@pytest.mark.redis_topologies("single", "cluster")
def test_sync_stream_with_usage(live, redis_client) -> None:
    api_key, plain = tenant_key()
    stream = client(live["url"], plain).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=12, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_len(HELLO), 12)
    assert all(c.usage is None for c in chunks[:-1])
    assert text
    record = rkeys.wait_usage_record(redis_client, rid_of(chunks[0].id))
    assert record["completion_tokens"] == 12 and record["stream"] is True
    procs.wait_until(lambda: counters(redis_client, api_key) == dict.fromkeys(
        ("conc_t", "conc_k", "streams_t", "streams_k"), 0), 5, "counters back")


def test_async_client_completions_stream_and_not(live, redis_client) -> None:
    _, plain = tenant_key()

    async def go() -> tuple[Any, list[Any]]:
        aclient = openai.AsyncOpenAI(base_url=live["url"] + "/v1", api_key=plain, max_retries=0)
        whole = await aclient.completions.create(model=MODEL, prompt="Once upon a time",
                                                 max_tokens=6)
        stream = await aclient.completions.create(model=MODEL, prompt="Once upon a time",
                                                  max_tokens=6, stream=True)
        chunks = [c async for c in stream]
        await aclient.close()
        return whole, chunks

    whole, chunks = asyncio.run(go())
    prompt_tokens = len(load_tokenizer(None).encode("Once upon a time"))
    assert whole.object == "text_completion" and whole.choices[0].text
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 6)
    assert whole.choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.redis_topologies("single", "cluster")
def test_async_chat_stream(live) -> None:
    _, plain = tenant_key()

    async def go() -> str:
        aclient = openai.AsyncOpenAI(base_url=live["url"] + "/v1", api_key=plain, max_retries=0)
        stream = await aclient.chat.completions.create(model=MODEL, messages=HELLO,
                                                       max_tokens=4, stream=True)
        out = [c.choices[0].delta.content or "" async for c in stream]
        await aclient.close()
        return "".join(out)

    assert asyncio.run(go())


def test_stop_sequences_and_sampling_parameters_reach_the_engine(live) -> None:
    _, plain = tenant_key()
    c = client(live["url"], plain)
    free = c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=200,
                                     temperature=0)
    text = free.choices[0].message.content
    words = text.split()
    assert len(words) > 3
    stop = " " + words[2]  # a string the greedy output is known to contain
    stopped = c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=200,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].message.content
    assert text.startswith(stopped.choices[0].message.content)
    assert stopped.usage.completion_tokens < free.usage.completion_tokens
    seeded = [c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=30,
                                        temperature=1.0, seed=11).choices[0].message.content
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_missing_max_tokens_fills_the_context_window(live, redis_client) -> None:
    _, plain = tenant_key(max_context_tokens=64, max_output_tokens=40)
    reply = client(live["url"], plain).chat.completions.create(model=MODEL, messages=HELLO)
    charged = redis_client.hget(rkeys.req_key(POOL, rid_of(reply.id)), "charged_out")
    limit = min(64 - prompt_len(HELLO), 40)
    assert reply.usage.completion_tokens <= limit
    if charged is not None:
        assert int(charged) == limit


# -- models and the allow-list ---------------------------------------------------------------


def test_models_lists_only_what_the_key_may_use(live) -> None:
    tenant = make_tenant()
    _, everything = make_key(tenant)
    _, narrow = make_key(tenant, allowed_models=[make_model(MODEL)])
    names = {m.id for m in client(live["url"], everything).models.list()}
    assert names == {MODEL, IDLE_MODEL}
    assert {m.id for m in client(live["url"], narrow).models.list()} == {MODEL}
    assert client(live["url"], narrow).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client(live["url"], narrow).chat.completions.create(model=IDLE_MODEL, messages=HELLO)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client(live["url"], narrow).models.retrieve(IDLE_MODEL)


def test_a_model_is_listed_and_served_only_while_a_live_worker_serves_it(live, redis_client
                                                                         ) -> None:
    """The catalog follows the workers: a configured pool without a live worker is not in
    /v1/models, and a request for its model is refused at once (a retryable 503 naming it,
    nothing charged) instead of waiting for the first-token deadline."""
    Pool.objects.get_or_create(name="late-pool", defaults={"model": make_model("sim-late")})
    api_key, plain = tenant_key(ttft_deadline_s=20)
    c = client(live["url"], plain)

    def listed() -> bool:
        return "sim-late" in {m.id for m in c.models.list()}

    def refused_at_once() -> None:
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            c.chat.completions.create(model="sim-late", messages=HELLO, max_tokens=3)
        assert time.monotonic() - started < 3  # not the 20 s first-token deadline
        # model_not_served (no live worker) or, once routing has marked the dead pool down,
        # routing's model_unavailable: both a retryable 503 naming the model.
        assert err.value.status_code == 503
        assert err.value.code in ("model_not_served", "model_unavailable")
        assert "`sim-late`" in err.value.message and err.value.response.headers["retry-after"]
        # Refused before admission: no request state, no counter, nothing charged.
        rid = err.value.response.headers["x-request-id"]
        assert not redis_client.exists(rkeys.req_key("late-pool", rid))
        assert counters(redis_client, api_key)["conc_t"] == 0

    def configured() -> bool:  # each gateway reads the pool table at most every 2 s
        try:
            c.chat.completions.create(model="sim-late", messages=HELLO, max_tokens=1)
        except openai.NotFoundError:
            return False
        except openai.APIStatusError:
            return True
        raise AssertionError("served with no worker")

    procs.wait_until(configured, 10, "the gateway to read the new pool")
    assert not listed()
    refused_at_once()
    assert bucket_level(redis_client, "tenant", api_key.tenant_id, "in") is None
    worker = procs.start_worker("late-pool", worker_id="late-w1", env=SERVER_ENV)
    try:
        procs.wait_for_worker(redis_client, "late-pool", "late-w1", worker)
        procs.wait_until(listed, 10, "the served model to be listed")
        reply = c.chat.completions.create(model="sim-late", messages=HELLO, max_tokens=3)
        assert reply.choices[0].message.content
    finally:
        worker.stop()
    # Stopped: unlisted once its heartbeat ages out (WORKER_DEAD_AFTER_SECONDS = 2).
    procs.wait_until(lambda: not listed(), 10, "the unserved model to leave the list")
    refused_at_once()
    assert [r["status"] for r in rkeys.usage_records(redis_client) if r["model"] == "sim-late"] == [
        "ok"]


# -- limits ----------------------------------------------------------------------------------


def test_context_and_output_limits_are_400(live, redis_client) -> None:
    _, plain = tenant_key(max_context_tokens=32, max_output_tokens=8)
    c = client(live["url"], plain)
    long_chat = [{"role": "user", "content": "word " * 200}]
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL, messages=long_chat, max_tokens=1)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=9)
    assert err.value.code == "max_tokens_exceeded"
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt="word " * 30, max_tokens=8)
    assert err.value.code == "context_length_exceeded"
    assert not redis_client.keys(key("bucket", "*")) and not rkeys.usage_records(redis_client)


def test_429_retry_after_from_the_refill_rate_and_nothing_charged(live, redis_client) -> None:
    prompt = prompt_len(HELLO)
    rate = 60  # one token a second, so Retry-After is the missing token count
    api_key, plain = tenant_key(input_tpm=rate, input_burst=2 * prompt - 3)
    c = client(live["url"], plain)
    c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    before = bucket_level(redis_client, "tenant", api_key.tenant_id, "in")
    t0 = time.time()
    with pytest.raises(openai.RateLimitError) as err:
        c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    headers = err.value.response.headers
    assert err.value.code == "rate_limit_exceeded"
    stored_ts = float(redis_client.hget(rkeys.tenant_bucket(api_key.tenant_id, "in"), "ts"))
    level_at_reject = before + (t0 - stored_ts) * rate / 60
    expected = math.ceil((prompt - level_at_reject) * 60 / rate)
    assert abs(int(headers["retry-after"]) - expected) <= 1
    assert int(headers["x-ratelimit-remaining-tokens"]) < prompt
    assert bucket_level(redis_client, "tenant", api_key.tenant_id, "in") == before  # untouched
    assert len(rkeys.usage_records(redis_client)) == 1  # only the first request
    assert counters(redis_client, api_key)["conc_t"] == 0


def test_a_request_larger_than_the_bucket_is_not_retried(live, redis_client) -> None:
    _, plain = tenant_key(output_tpm=50, output_burst=50, max_output_tokens=100)
    with pytest.raises(openai.RateLimitError) as err:
        client(live["url"], plain).chat.completions.create(model=MODEL, messages=HELLO,
                                                           max_tokens=80)
    assert err.value.code == "request_too_large"
    assert err.value.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in err.value.response.headers


def test_tenant_headers_are_ignored(live, redis_client) -> None:
    mine, plain = tenant_key()
    other = make_tenant()
    c = client(live["url"], plain, default_headers={
        "X-Tenant-Id": str(other.pk), "OpenAI-Organization": other.slug,
        "OpenAI-Project": other.slug})
    reply = c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    record = rkeys.wait_usage_record(redis_client, rid_of(reply.id))
    assert record["tenant_id"] == mine.tenant_id
    assert not redis_client.keys(rkeys.tenant_key("bucket", other.pk, "*"))


@pytest.mark.redis_topologies("single", "cluster")
def test_quota_holds_across_two_gateways(live, redis_client) -> None:
    prompt = prompt_len(HELLO)
    _, plain = tenant_key(input_tpm=1, input_burst=prompt * 3)  # three requests, ever
    second, url2 = procs.start_uvicorn(env=SERVER_ENV)
    with second:
        procs.wait_for_http(url2 + "/healthz", second)
        statuses = []
        for i in range(8):
            url = live["url"] if i % 2 else url2
            r = httpx.post(url + "/v1/chat/completions", timeout=30,
                           headers={"Authorization": f"Bearer {plain}"},
                           json={"model": MODEL, "messages": HELLO, "max_tokens": 1})
            statuses.append(r.status_code)
    assert sorted(statuses) == [200] * 3 + [429] * 5


# -- streams: disconnect, keep-alive, errors, resume -----------------------------------------


@pytest.mark.redis_topologies("single", "cluster")
def test_disconnect_mid_stream_bills_only_generated_tokens(live, redis_client) -> None:
    api_key, plain = tenant_key()
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 2000, "stream": True}
    rid = faults.hang_up_after(live["url"], plain, body, 5)
    closed_at = time.time()
    record = rkeys.wait_usage_record(redis_client, rid)
    assert record["status"] == "cancelled"
    assert 5 <= record["completion_tokens"] < 2000
    # The engine stopped within a step or so of the disconnect (250 tokens/s -> 4 ms a step).
    assert record["settled_at_ms"] / 1000 - closed_at < 1.0
    procs.wait_until(lambda: counters(redis_client, api_key) == dict.fromkeys(
        ("conc_t", "conc_k", "streams_t", "streams_k"), 0), 5, "counters back")
    out_level = bucket_level(redis_client, "tenant", api_key.tenant_id, "out")
    assert out_level is not None and out_level >= 100_000 - record["completion_tokens"] - 1

    def engine_idle() -> bool:  # the worker's heartbeat shows the sequence and its KV gone (I5)
        load = redis_client.hgetall(rkeys.worker_key(POOL, "live-w1", "load"))
        return load.get(b"running") == b"0" and load.get(b"kv_tokens_used") == b"0"

    procs.wait_until(engine_idle, 5, "the engine to free the sequence's KV blocks")




@pytest.mark.redis_topologies("single", "cluster")
def test_disconnect_while_queued_costs_nothing(live, redis_client) -> None:
    api_key, plain = tenant_key(ttft_deadline_s=20)
    body = {"model": IDLE_MODEL, "messages": HELLO, "max_tokens": 5, "stream": False}
    with contextlib.suppress(httpx.ReadTimeout):  # the client gives up while it is queued
        httpx.post(live["url"] + "/v1/chat/completions", json=body, timeout=0.5,
                   headers={"Authorization": f"Bearer {plain}"})
    record = procs.wait_until(lambda: rkeys.usage_records(redis_client), 5, "a record")[0]
    assert record["status"] == "cancelled" and record["completion_tokens"] == 0
    assert record["prompt_tokens"] == 0
    # The tenant's counters are given back by release.lua, the step after settle (ADR 0018).
    procs.wait_until(lambda: counters(redis_client, api_key)["conc_t"] == 0, 5, "the slot back")


def test_idle_stream_gets_keepalives_then_an_error_the_client_raises(live, redis_client) -> None:
    _, plain = tenant_key(ttft_deadline_s=1.5, total_deadline_s=10)
    with httpx.stream("POST", live["url"] + "/v1/chat/completions", timeout=10,
                      headers={"Authorization": f"Bearer {plain}"},
                      json={"model": IDLE_MODEL, "messages": HELLO, "stream": True}) as resp:
        assert resp.status_code == 200
        body = resp.read().decode()
    assert body.count(": keep-alive") >= 2
    error = json.loads(body.strip().splitlines()[-1].removeprefix("data: "))
    assert error["error"]["code"] == "ttft_deadline_exceeded"
    c = client(live["url"], plain)
    with pytest.raises(openai.APIError, match="first token"):
        list(c.chat.completions.create(model=IDLE_MODEL, messages=HELLO, stream=True))
    assert all(r["completion_tokens"] == 0 and r["prompt_tokens"] == 0
               for r in rkeys.usage_records(redis_client))


def test_failure_before_any_token_is_a_free_503(live, redis_client) -> None:
    api_key, plain = tenant_key(ttft_deadline_s=0.5, total_deadline_s=10)
    # The tables were emptied and refilled for this test: wait until the gateway's catalog
    # (read at most every couple of seconds) serves the idle model again.
    procs.wait_until(lambda: IDLE_MODEL in listed_models(live["url"], plain), 15,
                     "the idle model to be listed")
    r = httpx.post(live["url"] + "/v1/chat/completions", timeout=10,
                   headers={"Authorization": f"Bearer {plain}"},
                   json={"model": IDLE_MODEL, "messages": HELLO, "max_tokens": 5})
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "server_error"
    record = rkeys.wait_usage_record(redis_client, r.headers["x-request-id"])
    assert (record["prompt_tokens"], record["completion_tokens"]) == (0, 0)
    assert counters(redis_client, api_key)["conc_t"] == 0
    assert bucket_level(redis_client, "tenant", api_key.tenant_id, "in") == 200_000


@pytest.mark.redis_topologies("single", "cluster")
def test_resume_with_last_event_id(live) -> None:
    _, plain = tenant_key()
    headers = {"Authorization": f"Bearer {plain}"}
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 10, "stream": True}
    first = httpx.post(live["url"] + "/v1/chat/completions", json=body, headers=headers,
                       timeout=30).text
    events = sse_events(first)
    assert len(events) >= 4
    resume_from = events[2].splitlines()[0].removeprefix("id: ")
    again = httpx.post(live["url"] + "/v1/chat/completions", json=body, timeout=30,
                       headers={**headers, "Last-Event-ID": resume_from}).text
    assert sse_events(again) == events[3:]
    assert again.rstrip().endswith("data: [DONE]")
    _, stranger = tenant_key()
    r = httpx.post(live["url"] + "/v1/chat/completions", json=body, timeout=30,
                   headers={"Authorization": f"Bearer {stranger}", "Last-Event-ID": resume_from})
    assert r.status_code == 404  # another tenant's stream does not exist for you


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("declared", [{"tools": [TOOL]}, {"n": 2}, {"logprobs": True}])
def test_resuming_a_plain_stream_with_another_shape_is_a_400(live, declared) -> None:
    """Review 3, N12: a body declaring tools, n or logprobs cannot resume a plain stream (its
    entries would be read wrongly); a 400 naming the parameter, not a garbled 200 or a 500."""
    _, plain = tenant_key()
    headers = {"Authorization": f"Bearer {plain}"}
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 5, "stream": True}
    first = httpx.post(live["url"] + "/v1/chat/completions", json=body, headers=headers,
                       timeout=30).text
    resume_from = sse_events(first)[0].splitlines()[0].removeprefix("id: ")
    r = httpx.post(live["url"] + "/v1/chat/completions", json={**body, **declared}, timeout=30,
                   headers={**headers, "Last-Event-ID": resume_from})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == next(iter(declared))


# -- idempotency -----------------------------------------------------------------------------


def test_idempotency_key_replays_conflicts_and_rejects_a_new_body(live, redis_client) -> None:
    _, plain = tenant_key()
    headers = {"Authorization": f"Bearer {plain}", "Idempotency-Key": "abc-1"}
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 3}
    url = live["url"] + "/v1/chat/completions"
    first = httpx.post(url, json=body, headers=headers, timeout=30)
    reordered = json.dumps(dict(reversed(list(body.items()))))
    again = httpx.post(url, content=reordered, headers=headers, timeout=30)
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    assert len(rkeys.usage_records(redis_client)) == 1  # charged and run once
    other = httpx.post(url, json={**body, "max_tokens": 4}, headers=headers, timeout=30)
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    # Another tenant's identical key is its own.
    _, stranger = tenant_key()
    theirs = httpx.post(url, json=body, timeout=30, headers={
        "Authorization": f"Bearer {stranger}", "Idempotency-Key": "abc-1"})
    assert theirs.status_code == 200 and theirs.json()["id"] != first.json()["id"]


def test_idempotency_key_in_flight_is_409(live, redis_client) -> None:
    api_key, plain = tenant_key(ttft_deadline_s=1.5)
    claim = key("idem", api_key.tenant_id, hashlib.sha256(b"slow").hexdigest())
    headers = {"Authorization": f"Bearer {plain}", "Idempotency-Key": "slow"}
    body = {"model": IDLE_MODEL, "messages": HELLO, "max_tokens": 3}
    url = live["url"] + "/v1/chat/completions"
    results: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: results.append(
        httpx.post(url, json=body, headers=headers, timeout=30)))
    worker.start()
    procs.wait_until(lambda: redis_client.exists(claim), 10, "the first request's claim")
    second = httpx.post(url, json=body, headers=headers, timeout=30)
    worker.join()
    assert second.status_code == 409
    assert results[0].status_code == 503  # retryable failure: the key is released ...
    third = httpx.post(url, json=body, headers=headers, timeout=30)
    assert third.status_code == 503  # ... so the retry runs again rather than replaying


# -- bad input -------------------------------------------------------------------------------

BAD = [
    ("POST", "/v1/chat/completions", b"{not json", 400),
    ("POST", "/v1/chat/completions", b"\xff\xfe\x00", 400),
    ("POST", "/v1/chat/completions", b'{"model": "sim-live"}', 400),
    ("POST", "/v1/chat/completions", json.dumps({"model": 3, "messages": HELLO}).encode(), 400),
    ("POST", "/v1/chat/completions",
     json.dumps({"model": "nope", "messages": HELLO}).encode(), 404),
    ("POST", "/v1/chat/completions",
     json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": -5}).encode(), 400),
    ("POST", "/v1/chat/completions",
     json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 10**12}).encode(), 400),
    ("POST", "/v1/chat/completions",
     json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 100_000}).encode(), 400),
    ("POST", "/v1/chat/completions",
     json.dumps({"model": MODEL, "messages": HELLO, "n": 99}).encode(), 400),
    ("POST", "/v1/chat/completions",
     json.dumps({"model": MODEL, "messages": HELLO, "tools": [],
                 "tool_choice": "required"}).encode(), 400),
    ("POST", "/v1/chat/completions",
     json.dumps({"model": MODEL, "messages": HELLO, "bogus": 1}).encode(), 400),
    ("POST", "/v1/chat/completions",
     json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}).encode(),
     400),
    ("POST", "/v1/chat/completions", b"x" * (MAX_BYTES + 1), 413),
    ("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": [10**9]}).encode(), 400),
    ("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": ""}).encode(), 400),
    ("GET", "/v1/chat/completions", b"", 405),
    ("POST", "/v1/models", b"", 405),
    ("GET", "/v1/nothing-here", b"", 404),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), BAD)
def test_bad_input_is_an_openai_4xx_and_free(live, redis_client, method: str, path: str,
                                             body: bytes, status: int) -> None:
    _, plain = tenant_key()
    r = httpx.request(method, live["url"] + path, content=body, timeout=30,
                      headers={"Authorization": f"Bearer {plain}",
                               "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert not redis_client.keys(key("req", "*")) and not redis_client.keys(key("bucket", "*"))
    assert not rkeys.usage_records(redis_client)


INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")


def test_no_key_or_a_bad_key_is_401(live) -> None:
    r = httpx.post(live["url"] + "/v1/chat/completions", json={"model": MODEL}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(live["url"], "igw_wrong").models.list()


def test_every_inference_endpoint_refuses_no_key_a_wrong_key_and_a_revoked_key(
        live, redis_client) -> None:
    """401 on each endpoint, before anything is admitted or charged."""
    api_key, plain = tenant_key()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt": "hi",
            "input": "hi", "max_tokens": 2}

    def status(path: str, token: str | None) -> int:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.post(live["url"] + path, json=body, headers=headers, timeout=10).status_code

    for path in INFERENCE_PATHS:
        assert status(path, None) == 401, path
        assert status(path, "igw_wrong") == 401, path
    api_key.revoke()
    procs.wait_until(lambda: status("/v1/chat/completions", plain) == 401, 10,
                     "the revoked key to be refused")
    for path in INFERENCE_PATHS:
        assert status(path, plain) == 401, path
    assert not redis_client.keys(key("req", "*")) and not rkeys.usage_records(redis_client)


def test_metrics_endpoint(live, redis_client) -> None:
    from metering import writer

    api_key, plain = tenant_key(output_tpm=50, output_burst=50, max_output_tokens=100)
    c = client(live["url"], plain)
    c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    with pytest.raises(openai.RateLimitError):
        c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=80)
    procs.wait_until(lambda: rkeys.usage_records(redis_client), 5, "the usage record")
    writer.flush()
    text = httpx.get(live["url"] + "/metrics", timeout=10).text
    slug = api_key.tenant.slug
    assert value(text, "igw_tokens_total", tenant=slug, model=MODEL, direction="out") == 3
    assert value(text, "igw_rate_limited_total", tenant=slug, model=MODEL,
                 reason="too_large") == 1
    assert value(text, "igw_pool_running_sequences", pool=POOL) is not None
    assert value(text, "igw_pool_kv_cache_usage_ratio", pool=POOL) is not None


def test_content_is_logged_encrypted_only_for_tenants_that_opted_in(live, redis_client):
    from gateway.contentlog.models import ContentRecord
    from gateway.contentlog.store import decrypt_record, drain_all

    opted, plain_opted = tenant_key()
    opted.tenant.content_logging = True
    opted.tenant.save()
    _other, plain_other = tenant_key()
    for plain in (plain_opted, plain_other):
        client(live["url"], plain).chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=8)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client(live["url"], plain_opted).chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=8, stream=True)
        if chunk.choices
    )

    def drained() -> list[ContentRecord] | None:
        drain_all()
        found = list(ContentRecord.objects.all())
        return found if len(found) >= 2 else None

    records = procs.wait_until(drained, 10, "two content records")
    assert {r.tenant_id for r in records} == {opted.tenant_id}  # nothing of the other tenant
    for record in records:
        assert b"Say hello" not in bytes(record.ciphertext)  # sealed, not stored in the clear
    opened = [decrypt_record(r) for r in records]
    assert all(o["prompt"] == HELLO for o in opened)
    assert streamed in [o["response"] for o in opened]
