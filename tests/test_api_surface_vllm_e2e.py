"""Tools, structured outputs, n, logprobs, ``/v1/responses`` and ``/v1/embeddings`` through the
whole path on real vLLM: gateway -> WFQ -> Celery workers hosting the ``vllm`` backend (the tiny
random model, once as a generator and once through vLLM's pooling runner as an embedding model)
-> the official ``openai`` client and LangChain. A random model writes no sensible call on its
own, so what is checked is what constrained decoding guarantees: forced tool calls and response
formats are valid against their schemas; and usage is exactly the tokenizer's count of the
rendered prompt (tool definitions included, schemas not, n choices' prompt once).

Skipped, saying why, where the real-vLLM fixtures (``tests/vllm_fixtures.py``) are not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Callable, Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

vf = pytest.importorskip("tests.vllm_fixtures", reason="the real-vLLM fixtures are not here")

from catalog.models import Pool  # noqa: E402
from infra.redis_conn import get_redis  # noqa: E402
from serving.tokenization import load_tokenizer  # noqa: E402
from tests import procs, rkeys  # noqa: E402
from tests.agents_run import run_weather_agent  # noqa: E402
from tests.factories import make_key, make_model, make_tenant  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

# The generator is the vLLM stack this module shares with test_vllm_e2e (tests/vllm_fixtures.py).
POOL, MODEL, WORKER = vf.STACK_POOL, vf.STACK_MODEL, vf.STACK_WORKER
EMBED_POOL, EMBED, EMBED_WORKER = "vllm-embed", "tiny-vllm-embed", "vllm-embed-w1"
TOK = load_tokenizer(None)  # the tiny model's own tokenizer files (tests/vllm_model.py)
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
    vf.ensure_stack_pool(tiny)
    # The same weights served as an embedding model: task "embed" runs vLLM's pooling runner.
    embedder = make_model(EMBED, engine_model_id=str(tiny.model), tokenizer_path=str(tiny.model),
                          max_model_len=vf.MAX_MODEL_LEN, task="embed")
    Pool.objects.get_or_create(name=EMBED_POOL, defaults={
        "model": embedder, "backend": "vllm", "max_sequences": 8, "kv_cache_tokens": 100_000,
        "backend_settings": {"enforce_eager": True, "kv_cache_memory_bytes": vf.KV_BYTES}})


def prompt_tokens(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> int:
    return len(TOK.apply_chat_template(messages, tools=tools))


@pytest.fixture(scope="module")
def system(vllm_stack: dict[str, Any], django_db_blocker: Any) -> Iterator[dict[str, Any]]:
    """The shared gateway and generator, and this module's embedding worker."""
    tiny = vllm_stack["tiny"]
    with pool_worker(EMBED_POOL, EMBED_WORKER, lambda: ensure_pool(tiny),
                     django_db_blocker, timeout=vf.START_TIMEOUT_S) as embedder:
        yield {**vllm_stack, "embedder": embedder}


@pytest.fixture
def c(system: dict[str, Any], redis_client: Any) -> openai.OpenAI:
    ensure_pool(system["tiny"])
    procs.wait_for_worker(redis_client, POOL, WORKER, system["worker"], timeout=30)
    procs.wait_for_worker(redis_client, EMBED_POOL, EMBED_WORKER, system["embedder"], timeout=30)
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
    # Metering: the tool definitions are prompt tokens, exactly as the template renders them.
    assert named.usage.prompt_tokens == prompt_tokens(ASK, [WEATHER]) > prompt_tokens(ASK)
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
    assert parsed.usage.prompt_tokens == prompt_tokens(ASK)  # a schema is no prompt text
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, max_tokens=8, n=2, logprobs=True, top_logprobs=2,
        extra_body={"min_tokens": 8})
    reply = raw.parse()
    assert [ch.index for ch in reply.choices] == [0, 1]
    assert reply.usage.completion_tokens == 16
    assert reply.usage.prompt_tokens == prompt_tokens(ASK)  # the prompt once for n choices
    assert all(len(ch.logprobs.content) == 8 for ch in reply.choices)

    settled = rkeys.wait_usage_record(redis_client, raw.headers["x-request-id"])
    assert (settled["prompt_tokens"], settled["completion_tokens"]) == (prompt_tokens(ASK), 16)


def test_langchain_structured_output_on_vllm(system: dict[str, Any], c: openai.OpenAI) -> None:
    ChatOpenAI = pytest.importorskip("langchain_openai").ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=system["url"] + "/v1", api_key=system["plain"],
                     max_retries=0, max_tokens=1200, seed=3)
    assert isinstance(llm.with_structured_output(City).invoke("A city."), City)


def test_langchain_bind_tools_and_streaming_on_vllm(system: dict[str, Any],
                                                    c: openai.OpenAI) -> None:
    """bind_tools with a named and a required tool, invoked and streamed: the calls LangChain
    parses are valid against the tool's schema (an enum argument, see City)."""
    ChatOpenAI = pytest.importorskip("langchain_openai").ChatOpenAI
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """Current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(model=MODEL, base_url=system["url"] + "/v1", api_key=system["plain"],
                     max_retries=0, max_tokens=300, seed=3)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Oslo?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Oslo", "Paris")
    assert message.usage_metadata["input_tokens"] > 0
    chunks = list(llm.bind_tools([get_weather], tool_choice="required").stream("Weather?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert [t["name"] for t in merged.tool_calls] == ["get_weather"]
    assert merged.tool_calls[0]["args"]["city"] in ("Oslo", "Paris")
    text = "".join(str(ch.content) for ch in
                   ChatOpenAI(model=MODEL, base_url=system["url"] + "/v1",
                              api_key=system["plain"], max_retries=0, max_tokens=8).stream("Hi"))
    assert text


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_agents_sdk_tool_using_agent_on_vllm(system: dict[str, Any], c: openai.OpenAI,
                                            api: str) -> None:
    """The Agents SDK runs a tool-using agent on real vLLM with both model classes, streamed
    and not. A random model decides nothing sensible, so the tool is required (constrained
    decoding writes the call) and the agent stops on the tool's result."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen: list[str] = []
    for stream in (False, True):
        seen.clear()
        result = asyncio.run(run_weather_agent(
            system["url"], system["plain"], MODEL, responses=api == "responses", seen=seen,
            city_type=Literal["Oslo", "Paris"], stream=stream, max_turns=2,
            model_settings=agents.ModelSettings(tool_choice="required", max_tokens=300,
                                                parallel_tool_calls=False),
            tool_use_behavior="stop_on_first_tool"))
        assert len(seen) == 1 and seen[0] in ("Oslo", "Paris")
        assert result.final_output == f"Sunny in {seen[0]}"


EMBED_TEXTS = ["the gateway queues requests fairly", "zebras graze"]


def checked_embeddings(c: openai.OpenAI, model: str, redis_client: Any) -> list[list[float]]:
    """Embed EMBED_TEXTS through the gateway and check what holds for every embedding pool of
    the tiny model: one 128-wide vector per input in order, base64 (the client's default)
    decoding to the same numbers, usage and the settled record equal to the tokenizer's count.
    Returns the float vectors."""
    raw = c.embeddings.with_raw_response.create(model=model, input=EMBED_TEXTS,
                                                encoding_format="float")
    reply = raw.parse()
    vectors = [d.embedding for d in reply.data]
    assert [d.index for d in reply.data] == [0, 1] and all(len(v) == 128 for v in vectors)
    again = c.embeddings.create(model=model, input=EMBED_TEXTS[0])
    assert again.data[0].embedding == pytest.approx(vectors[0], abs=1e-6)
    expected = sum(len(TOK.encode(t)) for t in EMBED_TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == expected
    record = rkeys.wait_usage_record(redis_client, raw.headers["x-request-id"])
    assert (record["prompt_tokens"], record["completion_tokens"], record["status"]) == (
        expected, 0, "ok")
    return vectors


def test_embeddings_on_vllm_pooling_runner(c: openai.OpenAI, redis_client: Any) -> None:
    vectors = checked_embeddings(c, EMBED, redis_client)
    # Normalised (vLLM's embed pooler), and distinct.
    assert all(abs(math.fsum(x * x for x in v) - 1) < 1e-3 for v in vectors)
    assert vectors[0] != vectors[1]
    # Not a Matryoshka model: `dimensions` is a 400 naming it, and nothing is charged.
    with pytest.raises(openai.BadRequestError) as err:
        c.embeddings.create(model=EMBED, input=EMBED_TEXTS[0], dimensions=32)
    assert "`dimensions`" in str(err.value) and err.value.code == "engine_refused"
    assert err.value.param == "dimensions"
    refused = rkeys.wait_usage_record(redis_client, err.value.response.headers["x-request-id"])
    assert (refused["prompt_tokens"], refused["completion_tokens"]) == (0, 0)


def test_responses_on_vllm(c: openai.OpenAI, redis_client: Any) -> None:
    # (A random model may draw end-of-sequence early: then the response is "completed".)
    text = c.responses.create(model=MODEL, input="Say hello.", max_output_tokens=6,
                              store=False)
    out = text.usage.output_tokens
    assert text.status == ("incomplete" if out == 6 else "completed") and 1 <= out <= 6
    assert text.usage.input_tokens == prompt_tokens([{"role": "user", "content": "Say hello."}])
    record = rkeys.wait_usage_record(redis_client, text.id.removeprefix("resp_"))
    assert record["completion_tokens"] == out
    # An enum, not a free string (see City): the random model's free strings break JSON.
    params = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "name": "get_weather", "parameters": params, "strict": True}]
    called = c.responses.create(model=MODEL, input=ASK, tools=tools, tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=1000)
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1, called.output
    call = calls[0]
    jsonschema.validate(json.loads(call.arguments), params)
    # The function tool as the template renders it: the chat tool it means, `strict` included.
    as_chat = {"type": "function", "function": {"name": "get_weather", "parameters": params,
                                                "strict": True}}
    assert called.usage.input_tokens == prompt_tokens(ASK, [as_chat]) > prompt_tokens(ASK)
    events = list(c.responses.create(model=MODEL, input="Hi", max_output_tokens=4,
                                     stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.incomplete", "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text
    streamed_call = list(c.responses.create(model=MODEL, input=ASK, tools=tools,
                                            tool_choice="required", parallel_tool_calls=False,
                                            max_output_tokens=1000, stream=True))
    args = "".join(e.delta for e in streamed_call
                   if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(args), params)
    assert streamed_call[-1].type == "response.completed"


UP_POOL, UP_MODEL, UP_WORKER = "vllm-upstream-surface", "tiny-vllm-upstream", "vllm-up-w1"


def ensure_upstream_pool(tiny: Any, url: str) -> None:
    model = make_model(UP_MODEL, engine_model_id="tiny", tokenizer_path=str(tiny.model),
                       max_model_len=vf.MAX_MODEL_LEN)
    Pool.objects.get_or_create(name=UP_POOL, defaults={
        "model": model, "backend": "openai_upstream", "max_sequences": 8,
        "backend_settings": {"base_url": url, "model": "tiny", "dialect": "vllm"}})


@contextlib.contextmanager
def pool_worker(pool: str, worker_id: str, ensure: Callable[[], None],
                django_db_blocker: Any, timeout: float = 120) -> Iterator[Any]:
    """A Celery worker for ``pool``, once ``ensure`` has created the pool; its log on failure."""
    with django_db_blocker.unblock():
        ensure()
        worker = procs.start_worker(pool, worker_id=worker_id, env=ENV)
    try:
        procs.wait_for_worker(get_redis(), pool, worker_id, worker, timeout=timeout)
        yield worker
    except BaseException:
        print(worker.logs()[-4000:])
        raise
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def upstream_worker(system: dict[str, Any], vllm_server: Any, django_db_blocker: Any
                    ) -> Iterator[Any]:
    """A worker whose pool is `vllm serve` (the run's shared server) in the vllm dialect."""
    with pool_worker(UP_POOL, UP_WORKER,
                     lambda: ensure_upstream_pool(system["tiny"], vllm_server.url),
                     django_db_blocker) as worker:
        yield worker


def test_logprobs_through_a_vllm_serve_upstream_in_openai_shape(
        c: openai.OpenAI, system: dict[str, Any], vllm_server: Any, upstream_worker: Any,
        redis_client: Any) -> None:
    ensure_upstream_pool(system["tiny"], vllm_server.url)
    procs.wait_for_worker(redis_client, UP_POOL, UP_WORKER, upstream_worker, timeout=30)
    reply = c.chat.completions.create(model=UP_MODEL, messages=ASK, max_tokens=5,
                                      temperature=0, logprobs=True, top_logprobs=2,
                                      extra_body={"min_tokens": 5})
    choice = reply.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == reply.usage.completion_tokens == 5
    assert b"".join(bytes(e.bytes) for e in entries) == choice.message.content.encode()
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token  # greedy: the sampled token is the best
    assert reply.usage.prompt_tokens == prompt_tokens(ASK)
    text = c.completions.create(model=UP_MODEL, prompt="Fair queueing", max_tokens=4,
                                temperature=0, logprobs=1, extra_body={"min_tokens": 4})
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == text.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) == 1 for top in lp.top_logprobs)


UP_EMBED_POOL, UP_EMBED, UP_EMBED_WORKER = "vllm-upstream-embed", "tiny-vllm-up-embed", "vllm-ue-w1"


@pytest.fixture(scope="module")
def embed_server(tiny_vllm: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """`vllm serve` running the tiny model through its pooling runner, as an embedder."""
    server = vf.VLLMServer(tiny_vllm, procs.free_port(),
                           tmp_path_factory.mktemp("vllm-embed-serve") / "log", lora=False,
                           extra=["--runner", "pooling", "--convert", "embed"])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def ensure_upstream_embed_pool(tiny: Any, url: str) -> None:
    model = make_model(UP_EMBED, engine_model_id="tiny", tokenizer_path=str(tiny.model),
                       max_model_len=vf.MAX_MODEL_LEN, task="embed")
    Pool.objects.get_or_create(name=UP_EMBED_POOL, defaults={
        "model": model, "backend": "openai_upstream", "max_sequences": 8,
        "backend_settings": {"base_url": url, "model": "tiny", "dialect": "vllm"}})


@pytest.fixture(scope="module")
def upstream_embed_worker(system: dict[str, Any], embed_server: Any, django_db_blocker: Any
                          ) -> Iterator[Any]:
    """A worker whose embedding pool is that server, in the vllm dialect (token ids)."""
    with pool_worker(UP_EMBED_POOL, UP_EMBED_WORKER,
                     lambda: ensure_upstream_embed_pool(system["tiny"], embed_server.url),
                     django_db_blocker) as worker:
        yield worker


def test_embeddings_through_a_vllm_serve_upstream(
        c: openai.OpenAI, system: dict[str, Any], embed_server: Any, upstream_embed_worker: Any,
        redis_client: Any) -> None:
    """/v1/embeddings through the gateway to a real `vllm serve` embedder: the server's own
    vectors, float and base64, usage and the settled record equal to the tokenizer's count."""
    ensure_upstream_embed_pool(system["tiny"], embed_server.url)
    procs.wait_for_worker(redis_client, UP_EMBED_POOL, UP_EMBED_WORKER, upstream_embed_worker,
                          timeout=30)
    vectors = checked_embeddings(c, UP_EMBED, redis_client)
    # What vLLM's server answers for the same token ids, asked directly.
    direct = httpx.post(embed_server.url + "/v1/embeddings", timeout=60, json={
        "model": "tiny", "input": [TOK.encode(t) for t in EMBED_TEXTS],
        "encoding_format": "float"}).json()
    for mine, theirs in zip(vectors, sorted(direct["data"], key=lambda d: d["index"]),
                            strict=True):
        assert mine == pytest.approx(theirs["embedding"], abs=1e-5)
