"""Property tests of the request parsers, and the OpenAPI description kept equal to them.

Whatever JSON (or bytes) arrives, ``requests.parse`` returns a typed request or raises an
``ApiError`` with a 4xx and an OpenAI-shaped body: never another exception, so never a 500.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.inference import openapi
from gateway.inference.errors import ApiError
from gateway.inference.requests import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    MAX_TOKENS_CEILING,
    UNSUPPORTED,
    InferenceRequest,
    parse,
    parse_object,
)

FIELDS = sorted(CHAT_FIELDS | COMPLETION_FIELDS | UNSUPPORTED | {"bogus"})
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x", 3]),
     "content": st.text(max_size=20) | json_values},
    optional={"name": json_values, "tool_calls": json_values})
# Bodies that look like real requests, so the fuzzer gets past the first check.
plausible = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "", 3]) | json_values},
    optional={"messages": st.lists(message, max_size=3) | json_values,
              "prompt": st.text(max_size=10) | st.lists(st.integers(-5, 2**32), max_size=3)
              | json_values,
              **{name: json_values for name in FIELDS if name not in {"model", "messages",
                                                                       "prompt"}}})
any_object = plausible | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6),
                                         json_values, max_size=6)


def _outcome(run: Any) -> InferenceRequest | ApiError:
    try:
        return run()
    except ApiError as err:
        return err


def _assert_typed_or_4xx(result: InferenceRequest | ApiError) -> None:
    if isinstance(result, ApiError):
        assert 400 <= result.status < 500
        body = json.loads(result.body())
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["message"]
        return
    assert isinstance(result.model, str) and result.model
    assert result.max_tokens is None or 1 <= result.max_tokens <= MAX_TOKENS_CEILING
    assert 0 <= result.temperature <= 2 and 0 <= result.top_p <= 1
    assert all(isinstance(s, str) and s for s in result.stop)
    if result.kind == "chat":
        assert result.messages and all(isinstance(m["content"], str) for m in result.messages)
    else:
        assert result.prompt != "" and result.prompt != ()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=any_object, kind=st.sampled_from(["chat", "completion"]))
def test_any_json_object_is_a_request_or_a_4xx(data: dict[str, Any], kind: str) -> None:
    _assert_typed_or_4xx(_outcome(lambda: parse_object(data, kind)))  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()),
       kind=st.sampled_from(["chat", "completion"]))
@example(raw=b"[" * 100_000, kind="chat")  # deep nesting: RecursionError must be a 400
@example(raw=b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
         kind="chat")
@example(raw=b'{"model": "m", "prompt": "x", "max_tokens": 1e400}', kind="completion")
@example(raw=b'{"model": NaN}', kind="chat")
def test_any_bytes_are_a_request_or_a_4xx(raw: bytes, kind: str) -> None:
    _assert_typed_or_4xx(_outcome(lambda: parse(raw, kind)))  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(data=plausible)
def test_parsing_is_deterministic(data: dict[str, Any]) -> None:
    first, again = (_outcome(lambda: parse_object(data, "chat")) for _ in range(2))
    if isinstance(first, ApiError):
        assert isinstance(again, ApiError) and again.payload() == first.payload()
    else:
        assert again == first


# -- the OpenAPI description ------------------------------------------------------------------


def _request_schema(name: str) -> dict[str, Any]:
    return openapi.spec()["components"]["schemas"][name]


def test_openapi_request_fields_are_exactly_what_the_parser_accepts() -> None:
    chat, completion = _request_schema("ChatCompletionRequest"), \
        _request_schema("CompletionRequest")
    assert set(chat["properties"]) == CHAT_FIELDS
    assert set(completion["properties"]) == COMPLETION_FIELDS
    assert chat["additionalProperties"] is False and completion["additionalProperties"] is False
    assert not UNSUPPORTED & set(chat["properties"])


def test_openapi_required_fields_are_what_the_parser_requires() -> None:
    for schema, kind, minimal in (
            ("ChatCompletionRequest", "chat",
             {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            ("CompletionRequest", "completion", {"model": "m", "prompt": "hi"})):
        required = _request_schema(schema)["required"]
        assert isinstance(parse_object(minimal, kind), InferenceRequest)  # type: ignore[arg-type]
        for name in required:  # dropping any required field is a 400 naming it
            without = {k: v for k, v in minimal.items() if k != name}
            err = _outcome(lambda body=without, k=kind: parse_object(body, k))  # type: ignore[arg-type]
            assert isinstance(err, ApiError) and err.param == name


def test_openapi_document_lists_every_inference_route() -> None:
    doc = openapi.spec()
    assert doc["openapi"].startswith("3.")
    assert set(doc["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                 "/v1/models/{model}", "/v1/responses", "/v1/embeddings"}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "408", "413", "429", "503"} <= set(responses)
    json.loads(openapi.spec_bytes())  # serialisable as served
