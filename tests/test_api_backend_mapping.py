"""Sampling parameters, structured outputs, logprobs and embeddings as each real backend is
asked for them: vLLM's SamplingParams keywords, and the upstream wire bodies per dialect."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx

from tests.test_upstream_backend import Fake, run_engine, settings
from tests.test_upstream_backend import req as up_req
from tests.test_vllm_backend import build
from tests.test_vllm_backend import req as vllm_req
from workers.engine.base import TokenLogprob
from workers.engine.upstream import UpstreamEngine, build_body
from workers.engine.vllm_backend import token_logprobs
from workers.tokenization import load_tokenizer

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
