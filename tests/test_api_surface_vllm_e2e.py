"""Tools, structured outputs, n and logprobs through the whole path on real vLLM: gateway ->
WFQ -> a Celery worker hosting the ``vllm`` backend (the tiny random model) -> the official
``openai`` client and LangChain. A random model writes no sensible call on its own, so what is
checked is what constrained decoding guarantees: forced tool calls and response formats are
valid against their schemas, and usage is what vLLM counted.

Skipped, saying why, where the real-vLLM fixtures (``tests/vllm_fixtures.py``) are not here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

vf = pytest.importorskip("tests.vllm_fixtures", reason="the real-vLLM fixtures are not here")

from infra.redis_conn import get_redis, key  # noqa: E402
from tenants.models import Pool  # noqa: E402
from tests import procs  # noqa: E402
from tests.factories import make_key, make_model, make_tenant  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

POOL, MODEL, WORKER = "vllm-surface", "tiny-vllm-surface", "vllm-surface-w1"
ENV = {"WORKER_HEARTBEAT_SECONDS": "0.3", "WORKER_DEAD_AFTER_SECONDS": "15",
       "HF_HUB_OFFLINE": "1"}
BIG = 10**9
QUOTA = {"input_tpm": BIG, "input_burst": BIG, "output_tpm": BIG, "output_burst": BIG,
         "max_output_tokens": 1500, "ttft_deadline_s": 120.0, "total_deadline_s": 300.0}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"], "additionalProperties": False}}}


class City(BaseModel):
    # An enum, not a free string: the grammar xgrammar builds for a free JSON string lets this
    # random-weight model put raw control characters in it, which no JSON parser accepts.
    # The test is about the plumbing (schema out, a constrained instance back, parsed).
    name: Literal["Paris", "Lyon", "Nice"]
    population: int = Field(ge=0, le=10**7)


def ensure_pool(tiny: Any) -> None:
    model = make_model(MODEL, engine_model_id=str(tiny.model), tokenizer_path=str(tiny.model),
                       max_model_len=vf.MAX_MODEL_LEN)
    Pool.objects.get_or_create(name=POOL, defaults={
        "model": model, "backend": "vllm", "max_sequences": 8, "kv_cache_tokens": 100_000,
        "backend_settings": {"enforce_eager": True, "kv_cache_memory_bytes": vf.KV_BYTES}})


@pytest.fixture(scope="module")
def system(tiny_vllm: Any, django_db_setup: Any, django_db_blocker: Any
           ) -> Iterator[dict[str, Any]]:
    with django_db_blocker.unblock():
        ensure_pool(tiny_vllm)
        worker = procs.start_worker(POOL, worker_id=WORKER, env=ENV)
        gateway, url = procs.start_uvicorn(env=ENV)
    try:
        procs.wait_for_worker(get_redis(), POOL, WORKER, worker, timeout=vf.START_TIMEOUT_S)
        procs.wait_for_http(url + "/healthz", gateway)
        yield {"url": url, "worker": worker, "tiny": tiny_vllm}
    except BaseException:
        print(worker.logs()[-4000:], gateway.logs()[-3000:])
        raise
    finally:
        gateway.stop()
        worker.stop()


@pytest.fixture
def c(system: dict[str, Any], redis_client: Any) -> openai.OpenAI:
    ensure_pool(system["tiny"])
    procs.wait_for_worker(redis_client, POOL, WORKER, system["worker"], timeout=30)
    _, plain = make_key(make_tenant(**QUOTA))
    system["plain"] = plain
    return openai.OpenAI(base_url=system["url"] + "/v1", api_key=plain, max_retries=0,
                         timeout=300)


def test_forced_tool_calls_on_vllm(c: openai.OpenAI) -> None:
    named = c.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = named.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=300, stream=True)
    args = "".join(d.function.arguments or "" for ch in stream if ch.choices
                   for d in ch.choices[0].delta.tool_calls or [])
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])


def test_parse_helper_n_and_logprobs_on_vllm(c: openai.OpenAI, redis_client: Any) -> None:
    # A seed keeps the random model's whitespace (which the grammar allows) the same each run.
    parsed = c.chat.completions.parse(model=MODEL, messages=ASK, response_format=City,
                                      max_tokens=1200, seed=3)
    assert isinstance(parsed.choices[0].message.parsed, City)
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, max_tokens=8, n=2, logprobs=True, top_logprobs=2,
        extra_body={"min_tokens": 8})
    reply = raw.parse()
    assert [ch.index for ch in reply.choices] == [0, 1]
    assert reply.usage.completion_tokens == 16
    assert all(len(ch.logprobs.content) == 8 for ch in reply.choices)

    def record() -> dict[str, Any] | None:
        rid = raw.headers["x-request-id"]
        records = [json.loads(r) for r in redis_client.lrange(key("usage", "pending"), 0, -1)]
        return next((r for r in records if r["request_id"] == rid), None)

    assert procs.wait_until(record, 10, "usage record")["completion_tokens"] == 16


def test_langchain_structured_output_on_vllm(system: dict[str, Any], c: openai.OpenAI) -> None:
    ChatOpenAI = pytest.importorskip("langchain_openai").ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=system["url"] + "/v1", api_key=system["plain"],
                     max_retries=0, max_tokens=1200, seed=3)
    assert isinstance(llm.with_structured_output(City).invoke("A city."), City)
