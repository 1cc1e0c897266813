"""Observability on the running system (issue 29): uvicorn, a Celery pool worker with the
simulated engine, real Redis and PostgreSQL, the official ``openai`` client.

One worker and one gateway serve the module; each test makes its own tenant and key.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from catalog.models import Pool
from tests import otlp_receiver, procs
from tests.factories import make_key, make_model, make_tenant
from tests.prom import value

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

POOL = "obs-pool"
MODEL = "sim-obs"
SERVER_ENV = {"WORKER_HEARTBEAT_SECONDS": "0.2", "WORKER_DEAD_AFTER_SECONDS": "2"}
HELLO = [{"role": "user", "content": "Say hello."}]


def ensure_pools() -> None:
    model = make_model(MODEL)
    Pool.objects.get_or_create(name=POOL, defaults={
        "model": model, "backend_settings": {"decode_tokens_per_s": 200.0},
        "max_sequences": 16})


@pytest.fixture(scope="module")
def receiver() -> Any:
    """An in-process OTLP/HTTP trace receiver the gateway and the worker export to."""
    found = otlp_receiver.Receiver()
    yield found
    found.stop()


@pytest.fixture(scope="module")
def system(live_system, receiver) -> Any:
    env = {**SERVER_ENV, **receiver.env()}
    return live_system(pool=POOL, worker_ids=["obs-w1"], env=env, prepare=ensure_pools)


@pytest.fixture
def live(system, redis_client) -> Any:
    ensure_pools()
    procs.wait_for_worker(redis_client, POOL, "obs-w1", system["worker"], timeout=10)
    return system


def client(url: str, plain: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=plain, max_retries=0)


def test_overhead_header_and_histogram(live):
    _, plain = make_key(make_tenant())
    oai = client(live["url"], plain)
    began = time.perf_counter()
    raw = oai.chat.completions.with_raw_response.create(model=MODEL, messages=HELLO,
                                                        max_tokens=20)
    total_ms = (time.perf_counter() - began) * 1000
    overhead = float(raw.headers["x-gateway-overhead-ms"])
    # The engine decodes 20 tokens at 200/s (100 ms): the gateway's share is well below that.
    assert 0 <= overhead < total_ms
    assert raw.parse().usage.completion_tokens == 20
    assert overhead < total_ms - 50, (overhead, total_ms)

    with oai.chat.completions.with_streaming_response.create(
            model=MODEL, messages=HELLO, max_tokens=5, stream=True) as streamed:
        streamed_overhead = float(streamed.headers["x-gateway-overhead-ms"])
        assert sum(1 for _ in streamed.iter_lines()) > 0
    assert 0 <= streamed_overhead < total_ms

    def counted() -> float | None:
        text = httpx.get(live["url"] + "/metrics").text
        return value(text, "igw_gateway_overhead_seconds_count", pool=POOL)

    procs.wait_until(lambda: (counted() or 0) >= 2, 10, "overhead histogram")
    text = httpx.get(live["url"] + "/metrics").text
    seconds = value(text, "igw_gateway_overhead_seconds_sum", pool=POOL)
    assert seconds is not None and 0 < seconds < counted() * total_ms / 1000


def test_request_log_shows_every_429_the_client_received(live, redis_client):
    from metering import writer
    from metering.models import RequestLogEntry
    from tenants.models import Project

    tenant = make_tenant(input_tpm=1, input_burst=50)  # a few requests, then 429s
    project = Project.objects.create(tenant=tenant, name="App", slug="app")
    api_key, plain = make_key(tenant)
    api_key.project = project
    api_key.save(update_fields=["project"])
    oai = client(live["url"], plain)
    received: dict[str, str] = {}  # request id -> what the client saw
    for i in range(12):
        try:
            reply = oai.chat.completions.with_raw_response.create(
                model=MODEL, messages=HELLO, max_tokens=2, user=f"end-user-{i % 2}")
            received[reply.headers["x-request-id"]] = "ok"
        except openai.RateLimitError as err:
            received[err.response.headers["x-request-id"]] = err.code
    refused = {rid for rid, code in received.items() if code != "ok"}
    assert refused and len(refused) < len(received)  # some served, some refused

    def logged() -> dict[str, RequestLogEntry]:
        writer.flush()
        return {e.request_id: e for e in RequestLogEntry.objects.filter(tenant=tenant)}

    procs.wait_until(lambda: len(logged()) == len(received), 15, "request log entries")
    entries = logged()
    assert set(entries) == set(received)
    for rid, code in received.items():
        entry = entries[rid]
        assert entry.api_key_id == api_key.pk and entry.model_name == MODEL
        assert entry.end_user in ("end-user-0", "end-user-1")
        assert entry.project_id == project.pk  # admitted (request hash) and refused alike
        if code == "ok":
            assert (entry.status, entry.http_status) == ("ok", 200)
            assert entry.completion_tokens == 2 and entry.ttft_ms is not None
        else:
            assert (entry.status, entry.http_status, entry.error_code) == (
                "refused", 429, code)
            assert entry.completion_tokens == 0 and entry.prompt_tokens > 0
    # The management API shows the same refusals, each with its code.
    from tests.worlds import make_user

    owner = make_user(f"owner-{tenant.pk}")
    tenant.memberships.create(user=owner, role="owner")
    from rest_framework.test import APIClient

    api = APIClient()
    api.force_authenticate(owner)
    page = api.get(f"/api/tenants/{tenant.slug}/requests/?status=refused").json()
    assert {r["request_id"] for r in page["results"]} == refused
    assert {r["error_code"] for r in page["results"]} == {"rate_limit_exceeded"}


def test_one_connected_trace_from_gateway_to_worker_without_content(live, receiver):
    tenant = make_tenant()
    api_key, plain = make_key(tenant)
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    oai = openai.OpenAI(base_url=live["url"] + "/v1", api_key=plain, max_retries=0,
                        default_headers={"traceparent": f"00-{client_trace}-{client_span}-01"})
    with oai.chat.completions.with_streaming_response.create(
            model=MODEL, messages=HELLO, max_tokens=6, stream=True,
            stream_options={"include_usage": True}) as streamed:
        assert streamed.headers["x-trace-id"] == client_trace  # the client's trace, continued
        text = "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices)
    assert text

    wanted = {"POST /v1/chat/completions", "authenticate", "admission", "queue_wait",
              "dispatch", "engine.prefill", "engine.decode", "settlement"}
    procs.wait_until(lambda: wanted <= {s.name for s in receiver.trace(client_trace)}, 20,
                     "the request's spans from both processes")
    spans = receiver.trace(client_trace)
    ids = {s.span_id for s in spans}
    # Connected: every span's parent is in the trace, or is the client's own span.
    assert all(s.parent_id in ids or s.parent_id == client_span for s in spans), spans
    root = next(s for s in spans if s.name == "POST /v1/chat/completions")
    assert root.parent_id == client_span
    assert {s.service for s in spans} == {"inference-gateway", "inference-gateway-worker"}
    worker_spans = [s for s in spans if s.service == "inference-gateway-worker"]
    assert all(s.parent_id == root.span_id for s in worker_spans)
    attrs = root.attributes
    assert attrs["tenant"] == tenant.slug and attrs["key.prefix"] == api_key.prefix
    assert attrs["gen_ai.request.model"] == MODEL and attrs["pool"] == POOL
    assert attrs["http.response.status_code"] == 200
    assert attrs["gen_ai.usage.output_tokens"] == 6 and attrs["gen_ai.usage.input_tokens"] > 0
    decode = next(s for s in spans if s.name == "engine.decode")
    assert decode.attributes["gen_ai.usage.output_tokens"] == 6
    # Never content: neither the prompt nor the completion in any attribute.
    values = " ".join(str(v) for s in spans for v in s.attributes.values())
    assert "Say hello" not in values and text.strip() not in values
