"""Sampling parameters, structured outputs, logprobs and embeddings as each real backend is
asked for them: vLLM's SamplingParams keywords, and the upstream wire bodies per dialect."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from serving.tokenization import load_tokenizer, sim_model_dir
from tests.test_upstream_backend import Fake, run_engine, settings
from tests.test_upstream_backend import req as up_req
from tests.test_vllm_backend import build, vsettings
from tests.test_vllm_backend import req as vllm_req
from workers.engine.base import EngineError, TokenLogprob
from workers.engine.registry import EngineSpec, build_engine
from workers.engine.upstream import UpstreamEngine, build_body, upstream_logprobs
from workers.engine.vllm_backend import VLLMEngine, token_logprobs

TOK = load_tokenizer(None)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_vllm_gets_penalties_bias_logprobs_and_structured_outputs() -> None:
    call = build(vllm_req(presence_penalty=0.5, frequency_penalty=-0.2, repetition_penalty=1.3,
                          min_tokens=4, logit_bias=((3, 2.0),), logprobs=2,
                          json_schema=json.dumps(SCHEMA), skip_special_tokens=False))
    s = call.sampling
    assert (s["presence_penalty"], s["frequency_penalty"], s["repetition_penalty"]) == (
        0.5, -0.2, 1.3)
    assert (s["min_tokens"], s["logit_bias"], s["logprobs"]) == (4, {3: 2.0}, 2)
    assert s["structured_outputs"] == {"json": SCHEMA}
    assert s["skip_special_tokens"] is False
    assert build(vllm_req(json_object=True)).sampling["structured_outputs"] == {
        "json_object": True}
    plain = build(vllm_req()).sampling
    assert not {"presence_penalty", "logprobs", "structured_outputs", "logit_bias"} & set(plain)


def test_vllm_logprobs_become_ours_ranked() -> None:
    lp = SimpleNamespace
    ranked = [{7: lp(logprob=-0.1, rank=1), 9: lp(logprob=-2.5, rank=2),
               4: lp(logprob=-3.0, rank=3)},
              {5: lp(logprob=-1.2, rank=2), 8: lp(logprob=-0.4, rank=1)}]
    out = token_logprobs([7, 5], ranked, 2)
    assert out == (TokenLogprob(7, -0.1, ((7, -0.1), (9, -2.5))),
                   TokenLogprob(5, -1.2, ((8, -0.4), (5, -1.2))))
    assert token_logprobs([7], ranked[:1], None) is None


def test_upstream_vllm_dialect_passes_structured_outputs_and_penalties_through() -> None:
    body = build_body(up_req(json_schema=json.dumps(SCHEMA), repetition_penalty=1.1,
                             min_tokens=2, presence_penalty=0.3, logit_bias=((11, -5.0),)),
                      settings("vllm"), TOK, "m")
    assert body["structured_outputs"] == {"json": SCHEMA}
    assert (body["repetition_penalty"], body["min_tokens"], body["presence_penalty"]) == (
        1.1, 2, 0.3)
    assert body["logit_bias"] == {"11": -5.0}
    openai_body = build_body(up_req(presence_penalty=0.3, repetition_penalty=1.1),
                             settings("openai"), TOK, "m")
    assert openai_body["presence_penalty"] == 0.3
    assert "repetition_penalty" not in openai_body and "structured_outputs" not in openai_body


def test_upstream_embeddings_pass_through() -> None:
    def respond(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/embeddings"
        return httpx.Response(200, json={"object": "list", "data": [
            {"object": "embedding", "index": 1, "embedding": [0.0, 1.0]},
            {"object": "embedding", "index": 0, "embedding": [1.0, 0.0]}]})

    fake = Fake(respond)
    engine = UpstreamEngine(settings("vllm"), transport=fake.transport)
    vectors = run_engine(engine, lambda e: e.embed("r", [[1, 2], [3]], dimensions=2))
    assert vectors == [[1.0, 0.0], [0.0, 1.0]]  # in input order
    assert fake.bodies[0] == {"model": "m", "input": [[1, 2], [3]], "encoding_format": "float",
                              "dimensions": 2}


@pytest.mark.parametrize(("dialect", "answer", "dims", "refused"), [
    # llama.cpp's server ignores `dimensions`: refused before any call.
    ("llama_cpp", None, 2, True),
    # A server that answers another width than asked did not honour it: the client's 400.
    ("openai", [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], 2, True),
    # The upstream's own 400 (a `dimensions` it refuses) is the client's 400 too.
    ("vllm", 400, 2, True),
    # A causal LM without pooling: one vector per token, a misconfigured upstream.
    ("llama_cpp", [[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0]]], None, False),
    ("vllm", [[1.0, 0.0]], None, False),  # one vector for two inputs
])
def test_upstream_embeddings_that_cannot_be_honoured_fail_clearly(
        dialect: str, answer: Any, dims: int | None, refused: bool) -> None:
    def respond(request: httpx.Request) -> httpx.Response:
        if answer == 400:
            return httpx.Response(400, json={"error": {"message": "bad dimensions"}})
        return httpx.Response(200, json={"object": "list", "data": [
            {"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(answer)]})

    fake = Fake(respond)
    engine = UpstreamEngine(settings(dialect), transport=fake.transport)
    with pytest.raises(EngineError) as err:
        run_engine(engine, lambda e: e.embed("r", [[1, 2], [3]], dimensions=dims))
    assert err.value.refused is refused and not err.value.retryable
    assert len(fake.bodies) == (0 if answer is None else 1)


def test_upstream_logprobs_are_asked_for_and_mapped_to_ids() -> None:
    body = build_body(up_req(logprobs=2), settings("vllm"), TOK, "m")
    assert (body["logprobs"], body["return_tokens_as_token_ids"]) == (2, True)
    llama = build_body(up_req(logprobs=0), settings("llama_cpp"), TOK, "m")
    assert llama["logprobs"] == 0 and "return_tokens_as_token_ids" not in llama
    assert "logprobs" not in build_body(up_req(), settings("vllm"), TOK, "m")
    # vLLM: exact ids; its top dict may hold k + 1 entries (the sampled token too).
    vllm = {"tokens": ["token_id:7", "token_id:5"], "token_logprobs": [-0.1, -1.2],
            "top_logprobs": [{"token_id:7": -0.1, "token_id:9": -2.5, "token_id:4": -3.0},
                             {"token_id:8": -0.4, "token_id:5": -1.2}]}
    assert upstream_logprobs(vllm, [7, 5], 2, TOK) == (
        TokenLogprob(7, -0.1, ((7, -0.1), (9, -2.5))),
        TokenLogprob(5, -1.2, ((8, -0.4), (5, -1.2))))
    # llama.cpp: token text, mapped with the model's tokenizer; -inf floors at -9999.
    a, b = TOK.encode(" queue")[0], TOK.encode(" fair")[0]
    text = {"tokens": [TOK.decode([a])], "token_logprobs": [float("-inf")],
            "top_logprobs": [{TOK.decode([b]): -0.5, TOK.decode([a]): -1.5}]}
    assert upstream_logprobs(text, [a], 5, TOK) == (
        TokenLogprob(a, -9999.0, ((b, -0.5), (a, -1.5))),)


def test_upstream_stream_relays_logprobs_per_delta() -> None:
    def respond(request: httpx.Request) -> httpx.Response:
        events = [{"choices": [{"index": 0, "text": "ab", "token_ids": [11, 12],
                                "finish_reason": None, "logprobs": {
                                    "tokens": ["token_id:11", "token_id:12"],
                                    "token_logprobs": [-1.0, -2.0],
                                    "top_logprobs": [{"token_id:11": -1.0},
                                                     {"token_id:12": -2.0}]}}]},
                  {"choices": [{"index": 0, "text": "", "token_ids": [],
                                "finish_reason": "length"}]}]
        body = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)
        return httpx.Response(200, content=body + b"data: [DONE]\n\n")

    engine = UpstreamEngine(settings("vllm"), transport=Fake(respond).transport)

    async def go(e: UpstreamEngine) -> list[Any]:
        return [d async for d in e.generate(up_req(logprobs=1, max_tokens=2))]

    deltas = run_engine(engine, go)
    assert deltas[0].logprobs == (TokenLogprob(11, -1.0, ((11, -1.0),)),
                                  TokenLogprob(12, -2.0, ((12, -2.0),)))


def test_an_embed_model_runs_vllms_pooling_runner() -> None:
    spec = EngineSpec("e", "vllm", {"kv_cache_memory_bytes": 1 << 24},
                      model_id=str(sim_model_dir()), task="embed")
    engine = build_engine(spec)
    assert isinstance(engine, VLLMEngine)
    args = engine.settings.async_engine_args(cpu=True)
    assert (args["runner"], args["convert"]) == ("pooling", "embed")
    plain = build_engine(EngineSpec("g", "vllm", {"kv_cache_memory_bytes": 1 << 24},
                                   model_id=str(sim_model_dir())))
    assert "runner" not in plain.settings.async_engine_args(cpu=True)  # type: ignore[attr-defined]


def test_a_dimensions_the_vllm_model_lacks_is_refused_before_the_engine() -> None:
    def engine_with(**model_config: Any) -> VLLMEngine:
        engine = VLLMEngine(vsettings(embed=True))
        engine._llm = SimpleNamespace(vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(**model_config)))
        return engine

    plain = engine_with(is_matryoshka=False, matryoshka_dimensions=None, embedding_size=128)
    for engine, dims in ((plain, 32),
                         (engine_with(is_matryoshka=True, matryoshka_dimensions=[64, 128],
                                      embedding_size=128), 32),
                         (engine_with(is_matryoshka=True, matryoshka_dimensions=None,
                                      embedding_size=128), 256)):
        with pytest.raises(EngineError) as info:
            asyncio.run(engine.embed("r", [[1, 2]], dimensions=dims))
        assert info.value.refused and "`dimensions`" in str(info.value)
    ok = engine_with(is_matryoshka=True, matryoshka_dimensions=[64, 128], embedding_size=128)
    ok._check_dimensions(64)  # a size the model names passes
    plain._check_dimensions(None)
