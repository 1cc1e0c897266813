"""Structured outputs and sampling parameters on the simulated engine: schema-valid documents
(checked with ``jsonschema``), penalties, logit_bias, min_tokens and logprobs acting as they
do on a model's logits; and the worker's framing of n choices."""

from __future__ import annotations

import json
import math
import random

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from serving.guided import SchemaError, check_schema, sample_json
from serving.tokenization import load_tokenizer
from tests.test_sim_engine import generate_one, req
from workers.engine.base import TokenDelta, TokenLogprob, Usage
from workers.engine.simulated import SimConfig, corpus_words
from workers.host import combine, frame

TOK = load_tokenizer(None)
CONFIG = SimConfig(kv_cache_tokens=8192, max_model_len=2048)
WORDS = list(corpus_words())


class Address(BaseModel):
    street: str
    zip_code: int


class Person(BaseModel):
    name: str
    age: int
    emails: list[str]
    address: Address
    nickname: str | None = None
    tags: list[Address] = []


SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
     "additionalProperties": False},
    Person.model_json_schema(),
    {"type": "array", "items": {"type": "integer", "minimum": 3, "maximum": 9},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {
        "kind": {"enum": ["a", "b"]}, "score": {"type": "number", "exclusiveMinimum": 0,
                                                 "maximum": 1},
        "when": {"type": "string", "format": "date-time"}, "ok": {"type": "boolean"},
        "none": {"type": "null"}, "fixed": {"const": 42},
        "either": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "integer"}]}},
     "required": ["kind", "score", "when", "ok", "none", "fixed", "either"]},
    # Recursive through $defs: bounded by the sampler's depth limit.
    {"$defs": {"node": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["children"]}}, "$ref": "#/$defs/node"},
]


@pytest.mark.parametrize("schema", SCHEMAS)
@given(seed=st.integers(0, 2**32))
@settings(max_examples=25, deadline=None)
def test_sampled_documents_validate_against_their_schema(schema, seed) -> None:
    check_schema(schema)
    text = sample_json(schema, random.Random(seed), WORDS)
    jsonschema.validate(json.loads(text), schema)


def test_unsupported_keywords_are_refused_up_front() -> None:
    with pytest.raises(SchemaError, match="pattern"):
        check_schema({"type": "object", "properties": {"x": {"type": "string",
                                                             "pattern": "a+"}}})
    with pytest.raises(SchemaError, match="resolve"):
        check_schema({"$ref": "#/$defs/missing"})


def test_engine_emits_a_schema_valid_document_then_stops() -> None:
    schema = Person.model_json_schema()
    run = generate_one(CONFIG, req("g", max_tokens=1000, json_schema=json.dumps(schema),
                                   temperature=1.0, seed=3))
    assert run.last.finish_reason == "stop"
    jsonschema.validate(json.loads(run.text), schema)
    again = generate_one(CONFIG, req("g", max_tokens=1000, json_schema=json.dumps(schema),
                                     temperature=1.0, seed=3))
    assert again.text == run.text  # deterministic for a seed
    # Billing counts the document's tokens and the end-of-sequence token.
    assert run.last.usage.output_tokens == len(TOK.encode(run.text)) + 1


def test_json_object_mode_and_truncation_by_max_tokens() -> None:
    run = generate_one(CONFIG, req("j", max_tokens=1000, json_object=True))
    assert isinstance(json.loads(run.text), dict) and run.last.finish_reason == "stop"
    cut = generate_one(CONFIG, req("j", max_tokens=3, json_object=True))
    assert cut.last.finish_reason == "length" and cut.last.usage.output_tokens == 3


def test_logprobs_report_the_sampling_distribution() -> None:
    run = generate_one(CONFIG, req("l", max_tokens=8, temperature=0, logprobs=3))
    entries = [lp for d in run.deltas for lp in d.logprobs or ()]
    assert len(entries) == 8 == len(run.ids)
    for entry, tid in zip(entries, run.ids, strict=True):
        assert entry.token_id == tid and entry.logprob <= 0
        assert 1 <= len(entry.top) <= 3
        assert entry.top[0][1] >= entry.top[-1][1]
        assert sum(math.exp(lp) for _, lp in entry.top) <= 1.0 + 1e-9
        assert entry.top[0] == (tid, entry.logprob)  # greedy takes the most likely token
    plain = generate_one(CONFIG, req("l", max_tokens=8, temperature=0))
    assert plain.ids == run.ids  # asking for logprobs does not change what is sampled


def test_logit_bias_forces_and_bans_tokens() -> None:
    target = TOK.encode(" gateway")[0]
    forced = generate_one(CONFIG, req("b", max_tokens=5, logit_bias=((target, 100.0),)))
    assert forced.ids == [target] * 5
    free = generate_one(CONFIG, req("b", max_tokens=40, temperature=0))
    banned_id = free.ids[0]
    banned = generate_one(CONFIG, req("b", max_tokens=40, temperature=0,
                                      logit_bias=((banned_id, -100.0),)))
    assert banned_id not in banned.ids


def test_penalties_reduce_repetition() -> None:
    def repeats(ids: list[int]) -> int:
        return len(ids) - len(set(ids))

    base = generate_one(CONFIG, req("p", max_tokens=150, temperature=0, ignore_eos=True))
    penalised = generate_one(CONFIG, req("p", max_tokens=150, temperature=0, ignore_eos=True,
                                         frequency_penalty=2.0, presence_penalty=2.0))
    assert repeats(penalised.ids) < repeats(base.ids)
    rep = generate_one(CONFIG, req("p", max_tokens=150, temperature=0, ignore_eos=True,
                                   repetition_penalty=5.0))
    assert repeats(rep.ids) < repeats(base.ids)


def test_min_tokens_masks_end_of_sequence() -> None:
    eos = TOK.eos_token_id
    free = generate_one(CONFIG, req("m", max_tokens=400, temperature=0))
    assert free.last.finish_reason == "stop"
    short = len(free.ids)
    held = generate_one(CONFIG, req("m", max_tokens=400, temperature=0, min_tokens=short + 5))
    assert len(held.ids) >= short + 5 and eos not in held.ids[: short + 4]


def test_frames_and_combined_usage_of_n_choices() -> None:
    delta = TokenDelta([5], "hi", logprobs=(TokenLogprob(5, -0.25, ((5, -0.25), (6, -2.0))),))
    piece = json.loads(frame(2, delta))
    assert piece == {"i": 2, "t": "hi", "lp": [[5, -0.25, [[5, -0.25], [6, -2.0]]]]}
    assert frame(0, TokenDelta([], "", "stop")).endswith("\n")
    lasts = [TokenDelta([], "", "stop", Usage(10, 4, 7)),
             TokenDelta([], "", "length", Usage(10, 10, 9))]
    combined = combine(lasts)
    assert combined is not None and combined.usage == Usage(10, 4, 16)  # the prompt once
    assert combine([lasts[0], None]) is None
    assert combine([lasts[0], TokenDelta([], "", "abort", Usage(10, 0, 1))]).finish_reason \
        == "abort"

