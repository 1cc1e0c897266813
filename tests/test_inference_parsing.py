"""Request parsing and validation: every bad body is an OpenAI-shaped 400, never an exception."""

from __future__ import annotations

import json

import pytest

from gateway.inference.errors import ApiError
from gateway.inference.requests import parse

CHAT = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}


def body(**fields: object) -> bytes:
    return json.dumps({**CHAT, **fields}).encode()


def refused(raw: bytes, kind: str = "chat") -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(raw, kind)  # type: ignore[arg-type]
    err = info.value
    payload = err.payload()["error"]
    assert set(payload) == {"message", "type", "param", "code"}
    assert 400 <= err.status < 500 and payload["message"]
    return err


def test_minimal_chat_request_has_openai_defaults() -> None:
    req = parse(body(), "chat")
    assert req.model == "sim-small"
    assert req.messages == ({"role": "user", "content": "hi"},)
    assert (req.max_tokens, req.temperature, req.top_p, req.stream) == (None, 1.0, 1.0, False)


def test_every_supported_parameter_is_read() -> None:
    req = parse(body(max_tokens=7, temperature=0.5, top_p=0.9, stop=["\n", "END"], seed=3,
                     user="u1", stream=True, stream_options={"include_usage": True}, n=1,
                     frequency_penalty=0, presence_penalty=0.0, ignore_eos=True), "chat")
    assert (req.max_tokens, req.temperature, req.top_p) == (7, 0.5, 0.9)
    assert (req.seed, req.user) == (3, "u1")
    assert req.stop == ("\n", "END") and req.stream and req.include_usage and req.ignore_eos


def test_max_completion_tokens_is_max_tokens() -> None:
    assert parse(body(max_completion_tokens=9), "chat").max_tokens == 9
    assert parse(body(max_tokens=9, max_completion_tokens=9), "chat").max_tokens == 9
    assert refused(body(max_tokens=9, max_completion_tokens=8)).param == "max_tokens"


def test_nulls_mean_not_given() -> None:
    req = parse(body(max_tokens=None, temperature=None, stop=None, stream=None), "chat")
    assert req.max_tokens is None and req.temperature == 1.0 and not req.stream


def test_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    msg = {"role": "user", "content": parts}
    assert parse(body(messages=[msg]), "chat").messages[0]["content"] == "ab"


def test_completion_prompt_forms() -> None:
    base = {"model": "m"}
    assert parse(json.dumps({**base, "prompt": "x"}).encode(), "completion").prompt == "x"
    assert parse(json.dumps({**base, "prompt": ["x"]}).encode(), "completion").prompt == "x"
    assert parse(json.dumps({**base, "prompt": [1, 2]}).encode(), "completion").prompt == (1, 2)
    assert parse(json.dumps({**base, "prompt": [[1, 2]]}).encode(), "completion").prompt == (1, 2)
    assert refused(json.dumps({**base, "prompt": ["a", "b"]}).encode(), "completion").code == (
        "unsupported_value")


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b"{not json", None, "invalid_json"),
        (b"[1, 2]", None, "invalid_json"),
        (b"", None, "invalid_json"),
        (b'{"model": "m", "messages": [], "x": NaN}', None, "invalid_json"),
        (b"\xff\xfe{}", None, "invalid_encoding"),
        (b"[" * 100_000, None, "invalid_json"),
        (json.dumps({"messages": CHAT["messages"]}).encode(), "model",
         "missing_required_parameter"),
        (json.dumps({"model": "m"}).encode(), "messages", "missing_required_parameter"),
        (body(model=5), "model", "invalid_type"),
        (body(messages="hi"), "messages", "invalid_type"),
        (body(messages=[]), "messages", "invalid_type"),
        (body(messages=["hi"]), "messages[0]", "invalid_type"),
        (body(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role", "invalid_value"),
        (body(messages=[{"role": "user", "content": 3}]), "messages[0].content", "invalid_type"),
        (body(messages=[{"role": "user", "content": "\ud800"}]), "messages[0].content",
         "invalid_encoding"),
        (body(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id",
         "missing_required_parameter"),
        (body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
         "messages[0].content[0]", "unsupported_value"),
        (body(max_tokens=-1), "max_tokens", "invalid_value"),
        (body(max_tokens=0), "max_tokens", "invalid_value"),
        (body(max_tokens=10**30), "max_tokens", "invalid_value"),
        (body(max_tokens="10"), "max_tokens", "invalid_type"),
        (body(max_tokens=True), "max_tokens", "invalid_type"),
        (body(max_tokens=1.5), "max_tokens", "invalid_type"),
        (body(temperature=3), "temperature", "invalid_value"),
        (body(temperature="hot"), "temperature", "invalid_type"),
        (body(top_p=-0.1), "top_p", "invalid_value"),
        (body(stop=["a", "b", "c", "d", "e"]), "stop", "invalid_type"),
        (body(stop=[1]), "stop", "invalid_type"),
        (body(stop=[""]), "stop", "invalid_value"),
        (body(seed="x"), "seed", "invalid_type"),
        (body(user=["x"]), "user", "invalid_type"),
        (body(stream="yes"), "stream", "invalid_type"),
        (body(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
        (body(stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage",
         "invalid_type"),
        (body(stream=True, stream_options={"other": 1}), "stream_options.other",
         "unknown_parameter"),
        (body(n=0), "n", "invalid_value"),
        (body(n=17), "n", "invalid_value"),
        (body(n="1"), "n", "invalid_type"),
        (body(tools={}), "tools", "invalid_type"),
        (body(tools=[], tool_choice="required"), "tool_choice", "invalid_value"),
        (body(verbosity="low"), "verbosity", "unsupported_parameter"),
        (body(safety_identifier=["x"]), "safety_identifier", "invalid_type"),
        (body(prompt_cache_key=3), "prompt_cache_key", "invalid_type"),
        (body(logit_bias={"x": 5}), "logit_bias", "invalid_value"),
        (body(logit_bias={"1": 101}), "logit_bias", "invalid_value"),
        (body(frequency_penalty=2.5), "frequency_penalty", "invalid_value"),
        (body(logprobs="yes"), "logprobs", "invalid_type"),
        (body(top_logprobs=3), "top_logprobs", "invalid_value"),
        (body(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
        (body(tool_choice="required"), "tool_choice", "invalid_value"),
        (body(response_format={"type": "xml"}), "response_format.type", "invalid_value"),
        (body(functions=[]), "functions", "unsupported_parameter"),
        (body(prompt="x"), "prompt", "unknown_parameter"),
        (body(tenant_id=7), "tenant_id", "unknown_parameter"),
    ],
)
def test_bad_chat_bodies_are_400(raw: bytes, param: str | None, code: str) -> None:
    err = refused(raw)
    assert err.status == 400
    assert (err.param, err.code) == (param, code)
    assert err.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": 5}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": [-1]}, "prompt"),
        ({"model": "m", "prompt": "x", "messages": []}, "messages"),
        ({"model": "m", "prompt": "x", "max_completion_tokens": 3}, "max_completion_tokens"),
    ],
)
def test_bad_completion_bodies_are_400(fields: dict[str, object], param: str) -> None:
    assert refused(json.dumps(fields).encode(), "completion").param == param


def test_error_body_is_openai_json() -> None:
    err = refused(body(n=0))
    assert json.loads(err.body()) == {"error": err.payload()["error"]}


def test_retry_after_rounds_up_to_whole_seconds() -> None:
    assert ApiError(429, "x", retry_after=0.2).headers["retry-after"] == "1"
    assert ApiError(429, "x", retry_after=2.01).headers["retry-after"] == "3"
