"""Structured outputs, logprobs and logit_bias on real vLLM (the tiny random model): what the
gateway asks of vLLM is honoured by vLLM itself, not only built correctly.

Uses the session's shared engine (``tests/vllm_fixtures.py``'s ``vllm_engine``); skipped, saying
why, where those fixtures or vLLM are not installed.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

pytest.importorskip("tests.vllm_fixtures", reason="the real-vLLM fixtures are not here")

from serving.tokenization import load_tokenizer
from workers.engine.base import EngineRequest, SamplingParams

TOK = load_tokenizer(None)
PROMPT = TOK.apply_chat_template([{"role": "user", "content": "Give me a city."}])
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer"}},
          "required": ["name", "population"], "additionalProperties": False}


def generate(vllm_engine: Any, rid: str, **sampling: Any) -> list[Any]:
    async def go(engine: Any) -> list[Any]:
        request = EngineRequest(rid, PROMPT, SamplingParams(**sampling), "s" * 64)
        return [d async for d in engine.generate(request)]

    return vllm_engine.run(go)


def test_vllm_structured_outputs_hold_even_for_a_random_model(vllm_engine: Any) -> None:
    # "name" is length-bounded: the rewrite of workers.engine.structured is what keeps raw
    # control characters (which a random model samples) out of it; json.loads is strict.
    deltas = generate(vllm_engine, "api-js", max_tokens=400, temperature=1.0,
                      json_schema=json.dumps(SCHEMA))
    assert deltas[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(d.text for d in deltas)), SCHEMA)
    obj = generate(vllm_engine, "api-jo", max_tokens=300, json_object=True)
    assert obj[-1].finish_reason == "stop"
    assert isinstance(json.loads("".join(d.text for d in obj)), dict)


def test_vllm_logprobs_and_logit_bias(vllm_engine: Any) -> None:
    deltas = generate(vllm_engine, "api-lp", max_tokens=5, temperature=0, logprobs=3)
    entries = [lp for d in deltas for lp in d.logprobs or ()]
    assert [lp.token_id for lp in entries] == [t for d in deltas for t in d.token_ids]
    assert all(lp.logprob <= 0 and 1 <= len(lp.top) <= 3 for lp in entries)
    assert all(entry.top[0][1] >= entry.top[-1][1] for entry in entries)
    forced = generate(vllm_engine, "api-bias", max_tokens=6, temperature=0,
                      logit_bias=((5, 100.0),), min_tokens=6)
    assert [t for d in forced for t in d.token_ids] == [5] * 6
