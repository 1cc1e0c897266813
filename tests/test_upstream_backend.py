"""The OpenAI-compatible upstream backend on its own: request bodies, counting, errors, timeouts.

The upstream is faked with ``httpx.MockTransport`` (unit tests of this one module), is the
vLLM-wire stand-in server (``tests/upstream_server.py``) called in-process through
``httpx.ASGITransport``, or is ``vllm serve`` itself (the run's shared server,
``tests/vllm_fixtures.py``): the body the ``vllm`` dialect sends, and the chunks vLLM answers
with, checked on the wire. The engine contract against real server processes (vLLM's and
llama.cpp's) is in ``test_engine_conformance.py``.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from serving.adapters import Adapter, AdapterCatalog
from serving.tokenization import load_tokenizer
from workers.engine.base import EngineError, EngineRequest, FinishReason, SamplingParams
from workers.engine.registry import EngineConfigError, EngineSpec, build_engine
from workers.engine.upstream import SSEData, UpstreamEngine, UpstreamSettings, build_body

TOK = load_tokenizer()
IDS = TOK.encode("Fair queueing bounds who waits; quotas bound how much a tenant takes.")
SALT = "s" * 64


def req(rid: str = "r1", max_tokens: int = 5, salt: str = SALT, **kw: Any) -> EngineRequest:
    adapter = kw.pop("adapter", None)
    priority = kw.pop("priority", 0)
    return EngineRequest(rid, list(kw.pop("ids", IDS)), SamplingParams(max_tokens=max_tokens, **kw),
                         cache_salt=salt, adapter=adapter, priority=priority)


def settings(dialect: str = "vllm", **kw: Any) -> UpstreamSettings:
    base = {"base_url": "http://upstream.test", "model": "m", "idle_timeout_s": 2.0,
            "first_byte_timeout_s": 2.0, "connect_timeout_s": 1.0}
    return UpstreamSettings.for_dialect(dialect, **{**base, **kw})


def sse(*events: dict[str, Any] | str) -> bytes:
    parts = [e if isinstance(e, str) else json.dumps(e) for e in events]
    return b"".join(f"data: {p}\n\n".encode() for p in parts)


def chunk(text: str, ids: list[int] | None = None, finish: str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "c", "object": "text_completion", "choices": [choice]}


class Fake:
    """A MockTransport that records request bodies and answers with ``respond``."""

    def __init__(self, respond: Callable[[httpx.Request], Any]) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[httpx.Headers] = []
        self._respond = respond
        self.transport = httpx.MockTransport(self._handle)

    async def _handle(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        self.headers.append(request.headers)
        out = self._respond(request)
        if asyncio.iscoroutine(out):
            out = await out
        return out


def run_engine(engine: UpstreamEngine, scenario: Callable[[UpstreamEngine], Any]) -> Any:
    async def main() -> Any:
        await engine.start()
        try:
            return await asyncio.wait_for(scenario(engine), 30)
        finally:
            await engine.stop()

    return asyncio.run(main())


async def collect(engine: UpstreamEngine, request: EngineRequest) -> list[Any]:
    return [d async for d in engine.generate(request)]


def generate(s: UpstreamSettings, fake: Fake, request: EngineRequest,
             catalog: AdapterCatalog | None = None) -> list[Any]:
    engine = UpstreamEngine(s, catalog=catalog, transport=fake.transport)
    return run_engine(engine, lambda e: collect(e, request))


# -- request bodies ------------------------------------------------------------------------


def test_vllm_dialect_sends_ids_salt_and_asks_for_ids_and_usage() -> None:
    body = build_body(req(stop_token_ids=(7,), ignore_eos=True, seed=3, stop=("\n",)),
                      settings(), TOK, "m")
    assert body["prompt"] == IDS
    assert body["cache_salt"] == SALT
    assert body["return_token_ids"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["stop_token_ids"] == [7] and body["ignore_eos"] is True
    assert body["seed"] == 3 and body["stop"] == ["\n"]
    assert "priority" not in body


def test_llama_cpp_dialect_sends_text_and_nothing_vllm_specific() -> None:
    body = build_body(req(stop_token_ids=(7,), ignore_eos=True), settings("llama_cpp"), TOK, "m")
    assert body["prompt"] == TOK.decode(IDS)
    assert TOK.encode(body["prompt"]) == IDS  # the server re-tokenizes to the same ids
    for key in ("cache_salt", "return_token_ids", "stream_options", "stop_token_ids",
                "ignore_eos"):
        assert key not in body


def test_max_tokens_is_clamped_to_the_context_window_and_priority_is_opt_in() -> None:
    s = settings(max_model_len=len(IDS) + 3, send_priority=True)
    body = build_body(req(max_tokens=100, priority=-4), s, TOK, "m")
    assert body["max_tokens"] == 3
    assert body["priority"] == -4
    with pytest.raises(EngineError) as info:
        build_body(req(), settings(max_model_len=len(IDS)), TOK, "m")
    assert info.value.retryable is False and info.value.refused  # the client's 400, uncharged


def test_a_request_without_salt_is_refused_before_any_call() -> None:
    fake = Fake(lambda r: httpx.Response(200, content=sse(chunk("x", [5], "stop"))))
    with pytest.raises(EngineError, match="salt") as info:
        generate(settings(), fake, req(salt=""))
    assert info.value.retryable is False and fake.bodies == []


def test_the_api_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = Fake(lambda r: httpx.Response(200, content=sse(chunk("x", [5], "stop"))))
    monkeypatch.setenv("UPSTREAM_KEY_TEST", "sk-upstream")
    generate(settings(api_key_env="UPSTREAM_KEY_TEST"), fake, req())
    assert fake.headers[0]["authorization"] == "Bearer sk-upstream"
    monkeypatch.delenv("UPSTREAM_KEY_TEST")
    with pytest.raises(EngineError, match="UPSTREAM_KEY_TEST"):
        generate(settings(api_key_env="UPSTREAM_KEY_TEST"), fake, req())


# -- counting --------------------------------------------------------------------------------


def test_the_upstreams_usage_wins_and_a_gap_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    usage = {"prompt_tokens": len(IDS), "completion_tokens": 3, "total_tokens": len(IDS) + 3,
             "prompt_tokens_details": {"cached_tokens": 16}}
    body = sse(chunk("a", [10]), chunk("b", [11], "stop"), {"choices": [], "usage": usage},
               "[DONE]")
    with caplog.at_level(logging.WARNING, logger="workers.engine.upstream"):
        deltas = generate(settings(), Fake(lambda r: httpx.Response(200, content=body)), req())
    assert [d.token_ids for d in deltas[:-1]] == [[10], [11]]
    last = deltas[-1]
    assert last.finish_reason == FinishReason.STOP
    assert (last.usage.prompt_tokens, last.usage.cached_prompt_tokens,
            last.usage.output_tokens) == (len(IDS), 16, 3)
    assert "differs" in caplog.text  # 2 streamed ids vs 3 reported: tokenizers disagree


def test_without_ids_or_usage_output_is_counted_with_the_tokenizer() -> None:
    words = ["The", " gateway", " meters", " tokens"]
    body = sse(*[chunk(w) for w in words], chunk("", finish="stop"), "[DONE]")
    deltas = generate(settings("llama_cpp"), Fake(lambda r: httpx.Response(200, content=body)),
                      req(max_tokens=10))
    text = "".join(d.text for d in deltas)
    assert text == "".join(words)
    assert deltas[-1].usage.output_tokens == len(TOK.encode(text))
    assert sum(len(d.token_ids) for d in deltas) == len(TOK.encode(text))


def test_a_length_finish_counts_exactly_max_tokens_without_ids() -> None:
    # Three chunks whose text re-encodes to fewer tokens than the model emitted.
    body = sse(chunk("ga"), chunk("te"), chunk("way", finish="length"), "[DONE]")
    deltas = generate(settings("llama_cpp"), Fake(lambda r: httpx.Response(200, content=body)),
                      req(max_tokens=3))
    assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert deltas[-1].usage.output_tokens == 3


# -- the event stream, read by hand --------------------------------------------------------


def test_sse_payloads_survive_any_split_of_the_bytes() -> None:
    body = (b": keep-alive\r\n\r\nevent: completion\r\ndata: {\"a\": 1}\r\n\r\n"
            b"id: 7\ndata:{\"b\": \"x\\ny\"}\n\ndata: [DONE]\n\ndata: {\"tail\": 1}")
    want = [b'{"a": 1}', b'{"b": "x\\ny"}', b"[DONE]", b'{"tail": 1}']
    for size in (1, 2, 3, 7, len(body)):
        sse, got = SSEData(), []
        for i in range(0, len(body), size):
            got += sse.feed(body[i:i + size])
        got += sse.close()  # the last line came without its newline
        assert got == want, size


async def _trickle(body: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(body), 5):  # chunks that split lines and JSON objects
        yield body[i:i + 5]


def test_stream_delivers_each_chunk_to_the_callback_as_generate_does() -> None:
    usage = {"prompt_tokens": len(IDS), "completion_tokens": 2, "total_tokens": len(IDS) + 2}
    body = sse(chunk("a", [10]), chunk("b", [11], "length"), {"choices": [], "usage": usage},
               "[DONE]")
    fake = Fake(lambda r: httpx.Response(200, content=_trickle(body)))

    async def both(engine: UpstreamEngine) -> tuple[list[Any], Any, list[Any]]:
        seen: list[Any] = []
        last = await engine.stream(req("s1", max_tokens=2), seen.append)
        return seen, last, await collect(engine, req("s2", max_tokens=2))

    seen, last, generated = run_engine(UpstreamEngine(settings(), transport=fake.transport), both)
    assert last is seen[-1] and last.finish_reason == FinishReason.LENGTH
    assert [(d.token_ids, d.text) for d in seen] == [(d.token_ids, d.text) for d in generated]
    assert (last.usage.prompt_tokens, last.usage.output_tokens) == (len(IDS), 2)


def test_stream_raises_the_upstreams_error_with_its_partial_usage() -> None:
    body = sse(chunk("a", [10]), {"error": {"message": "engine died", "code": 500}})
    fake = Fake(lambda r: httpx.Response(200, content=body))
    seen: list[Any] = []
    engine = UpstreamEngine(settings(), transport=fake.transport)
    with pytest.raises(EngineError, match="engine died") as info:
        run_engine(engine, lambda e: e.stream(req(), seen.append))
    assert info.value.retryable is True and info.value.usage.output_tokens == 1
    assert [d.token_ids for d in seen] == [[10]]
    assert not engine._streams  # nothing left running


# -- errors and timeouts -------------------------------------------------------------------


@pytest.mark.parametrize(("status", "retryable", "refused"), [
    (400, False, True), (404, False, False), (422, False, True), (429, True, False),
    (500, True, False), (503, True, False)])
def test_http_errors_map_to_retryable_or_final(status: int, retryable: bool,
                                               refused: bool) -> None:
    error = {"error": {"message": "upstream says no", "type": "x", "code": status}}
    fake = Fake(lambda r: httpx.Response(status, json=error))
    with pytest.raises(EngineError) as info:
        generate(settings(), fake, req())
    assert info.value.retryable is retryable
    assert info.value.refused is refused  # a 4xx about the request, before any output
    assert "upstream says no" in str(info.value)
    assert info.value.usage is not None and info.value.usage.output_tokens == 0


def test_an_error_event_mid_stream_fails_the_request_with_its_partial_usage() -> None:
    body = sse(chunk("a", [10]), {"error": {"message": "engine died", "code": 500}})
    with pytest.raises(EngineError, match="engine died") as info:
        generate(settings(), Fake(lambda r: httpx.Response(200, content=body)), req())
    assert info.value.retryable is True
    assert info.value.usage.output_tokens == 1


def test_a_stream_that_ends_without_a_finish_is_retryable() -> None:
    body = sse(chunk("a", [10]), "[DONE]")
    with pytest.raises(EngineError) as info:
        generate(settings(), Fake(lambda r: httpx.Response(200, content=body)), req())
    assert info.value.retryable is True


def test_an_unreachable_upstream_is_retryable() -> None:
    s = settings(base_url=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    engine = UpstreamEngine(s)
    with pytest.raises(EngineError, match="unreachable") as info:
        run_engine(engine, lambda e: collect(e, req()))
    assert info.value.retryable is True


def test_an_upstream_silent_between_chunks_times_out_within_the_idle_bound() -> None:
    async def stalls() -> AsyncIterator[bytes]:
        yield sse(chunk("a", [10]))
        await asyncio.sleep(30)

    fake = Fake(lambda r: httpx.Response(200, content=stalls()))
    started = time.monotonic()
    with pytest.raises(EngineError, match="timed out") as info:
        generate(settings(idle_timeout_s=0.3), fake, req())
    assert info.value.retryable is True
    assert time.monotonic() - started < 5
    assert info.value.usage.output_tokens == 1


def test_an_upstream_that_never_answers_times_out_at_the_first_byte_bound() -> None:
    async def never(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        return httpx.Response(200)

    started = time.monotonic()
    with pytest.raises(EngineError, match="timed out"):
        generate(settings(first_byte_timeout_s=0.3), Fake(never), req())
    assert time.monotonic() - started < 5


def test_abort_closes_the_upstream_response() -> None:
    closed = asyncio.Event()

    async def endless() -> AsyncIterator[bytes]:
        try:
            i = 0
            while True:
                yield sse(chunk("x", [10 + i % 50]))
                i += 1
                await asyncio.sleep(0.005)
        finally:
            closed.set()  # the transport stopped reading: the connection is gone

    fake = Fake(lambda r: httpx.Response(200, content=endless()))
    engine = UpstreamEngine(settings(), transport=fake.transport)

    async def scenario(e: UpstreamEngine) -> Any:
        got = []
        async for d in e.generate(req(max_tokens=1000)):
            got.append(d)
            if len(got) == 3:
                await e.abort("r1")
        await asyncio.wait_for(closed.wait(), 5)
        return got, e.load()

    got, load = run_engine(engine, scenario)
    assert got[-1].finish_reason == FinishReason.ABORT
    assert got[-1].usage.output_tokens >= 3
    assert load.running == 0


# -- adapters --------------------------------------------------------------------------------


def test_an_adapter_is_sent_as_its_model_name_only_for_its_owner() -> None:
    catalog = AdapterCatalog([Adapter("support", 7, "/loras/7/support")],
                             salt_of=lambda t: f"salt-{t}")
    fake = Fake(lambda r: httpx.Response(200, content=sse(chunk("x", [5], "stop"))))
    generate(settings(), fake, req(salt="salt-7", adapter="support"), catalog)
    assert fake.bodies[0]["model"] == "t7-support"
    with pytest.raises(EngineError, match="does not exist") as info:
        generate(settings(), fake, req(salt="salt-8", adapter="support"), catalog)
    assert info.value.retryable is False
    assert len(fake.bodies) == 1  # the other tenant's request never left the worker


# -- against the vLLM-wire server, in-process --------------------------------------------------


@pytest.mark.slow
def test_the_wire_server_round_trip_matches_vllms_protocol_where_vllm_imports() -> None:
    from tests.upstream_server import WireServer
    from workers.engine.simulated import SimConfig, SimulatedEngine

    sim = SimulatedEngine(SimConfig(kv_cache_tokens=8192, max_model_len=2048,
                                    decode_tokens_per_s=5000.0, pool_tokens_per_s=None))
    app = WireServer(sim, "sim")
    raw: list[bytes] = []

    async def main() -> list[Any]:
        await sim.start()
        transport = httpx.ASGITransport(app=app)
        engine = UpstreamEngine(settings(model="sim"), transport=transport)
        await engine.start()
        try:
            deltas = await collect(engine, req(max_tokens=6))
            async with httpx.AsyncClient(transport=transport) as client:
                body = build_body(req(max_tokens=3), settings(model="sim"), TOK, "sim")
                raw.append((await client.post("http://upstream.test/v1/completions",
                                              json=body)).content)
            return deltas
        finally:
            await engine.stop()
            await sim.stop()

    deltas = asyncio.run(main())
    assert deltas[-1].usage.output_tokens == sum(len(d.token_ids) for d in deltas) == 6
    events = [json.loads(line[5:]) for line in raw[0].decode().splitlines()
              if line.startswith("data:") and "[DONE]" not in line]
    assert events[-1]["usage"]["completion_tokens"] == 3
    stream_response = _vllm_completion_stream_response()
    for event in events:
        stream_response.model_validate(event)


def _vllm_completion_stream_response() -> Any:
    # The class moved from protocol.py to completion/protocol.py in later vLLM releases.
    for module in ("vllm.entrypoints.openai.completion.protocol",
                   "vllm.entrypoints.openai.protocol"):
        try:
            return importlib.import_module(module).CompletionStreamResponse
        except (ImportError, AttributeError):
            continue
    pytest.skip("vLLM is not importable here: the chunks were checked against the wire "
                "format as documented, not against vLLM's own protocol classes")


def test_vllm_serve_takes_the_vllm_dialects_body_and_answers_as_the_backend_expects(
        vllm_server: Any) -> None:
    """Token ids in, the tenant's salt honoured, ids back on every chunk, and a final usage
    chunk with cached tokens: the parts of vLLM's wire format the dialect relies on."""
    s = settings(base_url=vllm_server.url, model="tiny")
    ids = TOK.encode("Fair queueing bounds who waits. " * 20)  # past one 128-token KV block
    salt = f"wire-{time.monotonic_ns()}"

    def chunks(salt: str) -> list[dict[str, Any]]:
        body = build_body(req(max_tokens=7, ids=ids, salt=salt, ignore_eos=True), s, TOK, "tiny")
        assert body["prompt"] == ids and body["cache_salt"] == salt
        assert body["return_token_ids"] is True and body["stream_options"]["include_usage"]
        with httpx.stream("POST", s.completions_url, json=body, timeout=60) as resp:
            assert resp.status_code == 200, resp.read()
            return [json.loads(line[5:]) for line in resp.iter_lines()
                    if line.startswith("data:") and "[DONE]" not in line]

    first, again, other = chunks(salt), chunks(salt), chunks(salt + "-other")
    stream_response = _vllm_completion_stream_response()
    for event in first:
        stream_response.model_validate(event)
    text = [c for c in first if c["choices"]]
    streamed = [t for c in text for t in c["choices"][0]["token_ids"]]
    assert len(streamed) == 7 and all(0 <= t < TOK.vocab_size for t in streamed)
    assert text[-1]["choices"][0]["finish_reason"] == "length"
    usage = first[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), 7)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert again[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # same salt
    assert other[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # another salt


# -- registry --------------------------------------------------------------------------------


@pytest.mark.parametrize(("backend_settings", "message"), [
    ({}, "needs base_url"),
    ({"base_url": "http://x", "model": "m", "bogus": 1}, "unknown"),
    ({"base_url": "http://x", "model": "m", "idle_timeout_s": "5"}, "wrong type"),
    ({"base_url": "http://x", "model": "m", "dialect": "grpc"}, "dialect"),
    ({"base_url": "ftp://x", "model": "m"}, "http"),
    ({"base_url": "http://x", "model": "m", "lora": {"adapter_root": "/loras",
      "adapters": [{"name": "a", "tenant_id": 3, "path": "/loras/4/a"}]}}, "outside tenant 3"),
    ({"base_url": "http://x", "model": "m", "lora": {"adapter_root": "/loras",
      "adapters": [{"name": "a", "tenant_id": 3, "path": "/loras/3/../4/a"}]}}, "outside"),
])
def test_the_registry_rejects_bad_upstream_settings(backend_settings: dict[str, Any],
                                                     message: str) -> None:
    with pytest.raises(EngineConfigError, match=message):
        build_engine(EngineSpec("p", "openai_upstream", backend_settings))


def test_the_registry_builds_an_upstream_from_a_pool_like_object() -> None:
    class PoolSpecLike:  # any object with EngineSpec's fields
        name, backend = "p", "openai_upstream"
        backend_settings = {"base_url": "http://x/v1", "dialect": "vllm"}
        max_sequences, kv_cache_tokens, max_model_len, tokenizer_path = 9, 1000, 4096, ""
        model_id = "served-name"

    engine = build_engine(PoolSpecLike())
    assert isinstance(engine, UpstreamEngine)
    assert engine.settings.model == "served-name"
    assert engine.settings.max_connections == 9
    assert engine.settings.completions_url == "http://x/v1/completions"


@pytest.mark.django_db
def test_the_registry_builds_from_a_pool_row_and_guards_unsalted_upstreams() -> None:
    from tests.factories import make_model, make_pool, make_tenant

    llama = {"base_url": "http://127.0.0.1:9", "model": "tiny", "dialect": "llama_cpp"}
    shared = make_pool(make_model("tiny"), backend="openai_upstream", backend_settings=llama,
                       max_sequences=3)
    with pytest.raises(EngineConfigError, match="I1"):
        build_engine(shared)
    shared.dedicated_to = make_tenant()
    shared.save()
    engine = build_engine(shared)
    assert isinstance(engine, UpstreamEngine)
    assert engine.settings.prompt_format == "text"
    assert engine.settings.max_connections == 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
