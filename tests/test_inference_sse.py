"""SSE framing and the templated chunk JSON, checked against the official client's own models."""

from __future__ import annotations

import json

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gateway.inference import sse
from gateway.inference.bodies import ChunkTemplate, UsageCounts, completion_body


def test_event_frames_with_and_without_id() -> None:
    assert sse.event(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert sse.event(b"{}", "7-0") == b"id: 7-0\ndata: {}\n\n"
    assert sse.KEEPALIVE.startswith(b":") and sse.DONE == b"data: [DONE]\n\n"


def test_a_keep_alive_between_events_reaches_the_official_client_as_nothing() -> None:
    """After an event with an id, the openai SDK's decoder dispatches an event on any blank
    line (it keeps the last id, as the spec says, and checks it where the spec checks data):
    a keep-alive that ended in one reached it as an empty event, and ``sse.json()`` raised."""
    from openai._streaming import SSEDecoder

    tpl = ChunkTemplate("chat", "r1", 123, "sim-small", include_usage=False)
    wire = [sse.event(tpl.delta("a"), "r1/1-0"), sse.KEEPALIVE, sse.KEEPALIVE,
            sse.event(tpl.delta("b"), "r1/2-0"), sse.KEEPALIVE, sse.DONE]
    events = list(SSEDecoder().iter_bytes(iter(wire)))
    assert [e.data[:1] for e in events] == ["{", "{", "["]  # two chunks, then [DONE]
    assert [e.json()["choices"][0]["delta"]["content"] for e in events[:2]] == ["a", "b"]
    # Byte by byte too: a proxy may split the stream anywhere.
    assert [e.data for e in SSEDecoder().iter_bytes(iter(bytes([b]) for b in b"".join(wire)))
            ] == [e.data for e in events]


def test_last_event_id_names_request_and_entry() -> None:
    assert sse.parse_resume_id("abc123/1700000000000-3") == ("abc123", "1700000000000-3")
    assert sse.parse_resume_id(" abc/1-0 ") == ("abc", "1-0")
    for bad in (None, "", "1700000000000-3", "abc/", "abc/x-1", "a b/1-0", "abc/1-0\nx"):
        assert sse.parse_resume_id(bad) is None


def test_chat_chunks_are_valid_json_the_client_parses() -> None:
    tpl = ChunkTemplate("chat", "r1", 123, "sim-small", include_usage=True)
    tricky = 'quote " backslash \\ newline \n tab \t unicode é 𝄞 \u2028'
    for raw in (tpl.role(), tpl.delta(tricky), tpl.finish("stop")):
        assert b"\n" not in raw  # one data: line per event
        chunk = ChatCompletionChunk.model_validate(json.loads(raw))
        assert chunk.id == "chatcmpl-r1" and chunk.model == "sim-small" and chunk.usage is None
    delta = ChatCompletionChunk.model_validate(json.loads(tpl.delta(tricky))).choices[0].delta
    assert delta.content == tricky
    assert json.loads(tpl.finish("length"))["choices"][0]["finish_reason"] == "length"
    usage = ChatCompletionChunk.model_validate(json.loads(tpl.usage(UsageCounts(5, 3, 2))))
    assert usage.choices == [] and usage.usage is not None
    u = usage.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (5, 3, 8)
    assert usage.usage.prompt_tokens_details.cached_tokens == 2


def test_chunks_without_include_usage_carry_no_usage_key() -> None:
    tpl = ChunkTemplate("chat", "r1", 1, "m", include_usage=False)
    assert "usage" not in json.loads(tpl.delta("x"))


def test_completion_chunks() -> None:
    tpl = ChunkTemplate("completion", "r2", 1, "m", include_usage=False)
    # OpenAI itself sends finish_reason null mid-stream, which the client builds without validating.
    chunk = json.loads(tpl.delta("abc"))
    assert chunk["id"] == "cmpl-r2" and chunk["object"] == "text_completion"
    assert chunk["choices"] == [{"index": 0, "text": "abc", "logprobs": None,
                                 "finish_reason": None}]
    assert json.loads(tpl.finish("stop"))["choices"][0]["finish_reason"] == "stop"


def test_whole_responses_validate() -> None:
    usage = UsageCounts(prompt_tokens=4, completion_tokens=2, cached_tokens=0)
    chat = ChatCompletion.model_validate(
        completion_body("chat", "r", 5, "m", "hello", "stop", usage))
    assert chat.choices[0].message.content == "hello" and chat.usage.total_tokens == 6
    text = Completion.model_validate(
        completion_body("completion", "r", 5, "m", "hello", "length", usage))
    assert text.choices[0].finish_reason == "length" and text.object == "text_completion"
