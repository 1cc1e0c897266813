"""Security review 3, N1/N2/N12: a client's JSON schema is bounded before anything walks it, on
every backend, and the simulated engine's constrained decoding does work bounded by
``max_tokens``, whatever ``minItems`` or ``minLength`` say. A hypothesis fuzz of schemas and
tool parameters asserts bounded time and memory in the gateway's check and the worker's
sampler."""

from __future__ import annotations

import json
import random
import time
import tracemalloc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.inference.errors import ApiError
from gateway.inference.requests import InferenceRequest, parse
from gateway.inference.sampling import check_supported, sampling_params
from serving.guided import SchemaError, check_schema, sample_json_bounded
from serving.schema_limits import MAX_SCHEMA_EXPANDED
from tests.test_api_tools import BACKENDS
from tests.test_sim_engine import generate_one, req
from workers.engine.simulated import SimConfig

CONFIG = SimConfig(kv_cache_tokens=8192, max_model_len=2048)


def chain(levels: int) -> dict[str, Any]:
    """The review's schema: each level has two required properties that $ref the next."""
    defs: dict[str, Any] = {
        f"l{i}": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"$ref": f"#/$defs/l{i + 1}"}, "b": {"$ref": f"#/$defs/l{i + 1}"}}}
        for i in range(levels)}
    defs[f"l{levels}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/l0"}


def chat(**fields: Any) -> InferenceRequest:
    data = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse(json.dumps(data).encode(), "chat")


def as_response_format(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


def as_tool(schema: Any, choice: str = "auto") -> dict[str, Any]:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
            "tool_choice": choice}


def gateway_check(fields: dict[str, Any], backend: str = "sim") -> ApiError | None:
    request = chat(**fields)
    try:
        check_supported(request, sampling_params(request, 16), BACKENDS[backend])
    except ApiError as exc:
        return exc
    return None


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("where", ["response_format", "tools"])
def test_the_ref_chain_is_refused_fast_on_every_backend(backend: str, where: str) -> None:
    schema = chain(20)
    assert len(json.dumps(schema)) < 3000  # the review's 2.6 KB
    fields = as_response_format(schema) if where == "response_format" else as_tool(schema)
    started = time.perf_counter()
    error = gateway_check(fields, backend)
    assert time.perf_counter() - started < 0.2
    assert error is not None and error.status == 400, backend
    if error.code == "unsupported_parameter":  # a backend without constrained decoding
        return
    expected = "response_format" if where == "response_format" else \
        "tools[0].function.parameters"
    assert (error.param, error.code) == (expected, "invalid_value")
    assert "expands" in error.message


def test_a_shared_subschema_is_checked_once_and_a_modest_chain_is_accepted() -> None:
    assert gateway_check(as_response_format(chain(10))) is None
    with pytest.raises(SchemaError, match="expands"):
        check_schema(chain(14))


@pytest.mark.parametrize(("schema", "word"), [
    ({"type": "integer", "minimum": "a"}, "minimum"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 5, "maxItems": 2}, "minItems"),
    ({"type": "string", "minLength": -1}, "minLength"),
    ({"type": "widget"}, "type"),
    ({"type": "object", "properties": []}, "properties"),
])
@pytest.mark.parametrize("backend", ["sim", "vLLM", "up/vllm"])
def test_malformed_keywords_are_a_400_naming_the_parameter(schema: dict[str, Any], word: str,
                                                           backend: str) -> None:
    for fields, param in ((as_response_format(schema), "response_format"),
                          (as_tool(schema), "tools[0].function.parameters")):
        error = gateway_check(fields, backend)
        assert error is not None and (error.status, error.param) == (400, param)
        assert word in error.message


def test_huge_min_items_costs_what_max_tokens_allows() -> None:
    schema = {"type": "array", "minItems": 600000, "items": {"type": "integer"}}
    started = time.perf_counter()
    cut = generate_one(CONFIG, req("a", max_tokens=5, json_schema=json.dumps(schema), seed=1,
                                   temperature=1.0))
    assert time.perf_counter() - started < 1.0
    assert cut.last.finish_reason == "length" and cut.last.usage.output_tokens == 5
    # The prefix is the prefix of the document the schema describes: longer runs agree.
    longer = generate_one(CONFIG, req("a", max_tokens=200, json_schema=json.dumps(schema),
                                      seed=1, temperature=1.0))
    assert longer.text.startswith(cut.text) and longer.last.finish_reason == "length"


def test_huge_min_length_is_bounded_too() -> None:
    text, cut = sample_json_bounded({"type": "string", "minLength": 10**9},
                                    random.Random(1), ["word"], 1000)
    assert cut and len(text) < 2000


# -- fuzz: any schema, bounded time and memory ----------------------------------------------

NAMES = st.sampled_from(["a", "b", "c", "l0", "l1", "l2"])
REFS = st.builds(lambda n: {"$ref": f"#/$defs/{n}"}, NAMES)
LEAVES = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean",
                                                    "null"])}),
    st.builds(lambda n: {"type": "array", "minItems": n, "items": {"type": "integer"}},
              st.integers(0, 10**7)),
    st.builds(lambda n: {"type": "string", "minLength": n}, st.integers(0, 10**9)),
    st.builds(lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi},
              st.one_of(st.integers(), st.text(max_size=2)), st.integers()),
    REFS,
)


def _objects(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    props = st.dictionaries(NAMES, children, max_size=4)
    return st.one_of(
        st.builds(lambda p: {"type": "object", "properties": p, "required": sorted(p)}, props),
        st.builds(lambda c, n: {"type": "array", "items": c, "minItems": n}, children,
                  st.integers(0, 10**6)),
        st.builds(lambda cs: {"anyOf": cs}, st.lists(children, min_size=1, max_size=3)),
    )


SCHEMAS = st.recursive(LEAVES, _objects, max_leaves=30)
DOCUMENTS = st.builds(lambda root, defs: {**root, "$defs": defs} if isinstance(root, dict)
                      else root, SCHEMAS, st.dictionaries(NAMES, SCHEMAS, max_size=6))


def bounded(work: Any) -> tuple[float, int]:
    tracemalloc.start()
    started = time.perf_counter()
    try:
        work()
    finally:
        elapsed = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return elapsed, peak


@given(schema=DOCUMENTS, where=st.sampled_from(["response_format", "tools", "required"]))
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_fuzz_gateway_check_and_worker_sampler_are_bounded(schema: dict[str, Any],
                                                           where: str) -> None:
    fields = as_response_format(schema) if where == "response_format" else \
        as_tool(schema, "auto" if where == "tools" else "required")
    outcome: list[ApiError | None] = []
    elapsed, peak = bounded(lambda: outcome.append(gateway_check(fields)))
    assert elapsed < 1.0 and peak < 32 * 2**20
    error = outcome[0]
    if error is not None:
        assert error.status == 400 and error.param in (
            "response_format", "tools[0].function.parameters", "tool_choice")
        return
    # Accepted: the worker's sampler does work bounded by its budget, whatever the schema.
    result: list[tuple[str, bool]] = []
    elapsed, peak = bounded(lambda: result.append(
        sample_json_bounded(schema, random.Random(0), ["w"], 5 * 8 + 256)))
    assert elapsed < 1.0 and peak < 32 * 2**20
    assert len(result[0][0]) < 20 * MAX_SCHEMA_EXPANDED


# -- N12: other malformed input ---------------------------------------------------------------


@pytest.mark.parametrize("key", ["²", "1" * 5001, "-1", " 1"])
def test_a_malformed_logit_bias_key_is_a_400(key: str) -> None:
    with pytest.raises(ApiError) as info:
        chat(logit_bias={key: 1})
    assert (info.value.status, info.value.param) == (400, "logit_bias")


@pytest.mark.parametrize("fields", [{"n": 2}, {"logprobs": True}])
def test_resuming_a_plain_stream_with_a_framed_body_is_a_400(fields: dict[str, Any]) -> None:
    from gateway.inference.choices import Assembler, framed
    from gateway.inference.toolparsers import PARSERS
    from serving.tokenization import load_tokenizer

    request = chat(**fields)
    asm = Assembler(request, PARSERS["hermes"], load_tokenizer(None), framed(request))
    with pytest.raises(ApiError) as info:
        asm.feed("Hello there")  # the plain stream's text
    assert (info.value.status, info.value.param) == (400, next(iter(fields)))
