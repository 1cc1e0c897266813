"""The Responses API's translation to chat and its event sequence, and the embeddings request
parsing and vector packing, unit by unit."""

from __future__ import annotations

import asyncio
import base64
import json
from array import array
from typing import Any

import pytest

from gateway.inference import embeddings
from gateway.inference.bodies import UsageCounts
from gateway.inference.choices import Assembler
from gateway.inference.errors import ApiError
from gateway.inference.requests import parse_object
from gateway.inference.responses_api import ResponseBuilder, responses_param, to_chat
from gateway.inference.toolparsers import PARSERS
from serving.tokenization import load_tokenizer
from workers.engine.simulated import SimConfig, SimulatedEngine
from workers.host import pack_vectors

TOK = load_tokenizer(None)
TOOL = {"type": "function", "name": "get_weather", "description": "Weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}, "strict": True}


def test_a_responses_body_is_the_chat_body_it_means() -> None:
    chat = to_chat({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 50, "store": False,
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                            "strict": True}},
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": "{\"city\": \"Oslo\"}"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather",
             "arguments": "{\"city\": \"Rome\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ]})
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["max_completion_tokens"] == 50
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["tools"][0]["function"]["name"] == "get_weather"
    assert chat["response_format"]["json_schema"]["name"] == "x"
    assistant = chat["messages"][2]
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]  # one turn, two calls
    req = parse_object(chat, "chat")  # and the chat parser accepts it
    assert req.messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"model": "m", "input": "x", "bogus": 1}, "bogus"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "m", "input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
])
def test_responses_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        to_chat(body)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize(("chat_param", "param"), [
    ("messages", "input"), ("messages[2].content", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("tools[0].function.name", "tools[0].name"), ("temperature", "temperature"), (None, None),
])
def test_chat_parser_params_are_named_as_the_responses_client_sent_them(
        chat_param: str | None, param: str | None) -> None:
    assert responses_param(chat_param) == param


def test_responses_stream_events_for_text_then_a_call() -> None:
    req = parse_object(to_chat({"model": "m", "input": "Weather?", "tools": [TOOL]}), "chat")
    asm = Assembler(req, PARSERS["hermes"], TOK, False)
    builder = ResponseBuilder("r1", "m", {"tools": [TOOL]})
    events = builder.start()
    events += builder.feed(asm.feed("Checking. "))
    events += builder.feed(asm.feed('<tool_call>{"name": "get_weather", '
                                    '"arguments": {"city": "Oslo"}}</tool_call>'))
    events += builder.feed(asm.finish("stop"))
    events += builder.end(UsageCounts(10, 5))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["id"] == "resp_r1"
    message, call = final["output"]
    assert message["content"][0]["text"] == "Checking. "
    assert (call["type"], call["name"], json.loads(call["arguments"])) == (
        "function_call", "get_weather", {"city": "Oslo"})
    assert final["usage"]["input_tokens"] == 10 and final["usage"]["total_tokens"] == 15


def test_embedding_requests_parse_and_refuse() -> None:
    req = embeddings.parse({"model": "e", "input": ["a", [1, 2]], "dimensions": 8,
                            "encoding_format": "base64"})
    assert req.inputs == ("a", (1, 2)) and req.dimensions == 8
    assert embeddings.parse({"model": "e", "input": [5, 6]}).inputs == ((5, 6),)
    for body, param in [({"model": "e"}, "input"), ({"model": "e", "input": [""]}, "input"),
                        ({"model": "e", "input": "x", "dimensions": 0}, "dimensions"),
                        ({"model": "e", "input": "x", "encoding_format": "hex"},
                         "encoding_format"),
                        ({"model": "e", "input": "x", "extra": 1}, "extra")]:
        with pytest.raises(ApiError) as info:
            embeddings.parse(body)
        assert info.value.param == param


def test_vectors_round_trip_through_the_stream_and_base64() -> None:
    vectors = [[0.5, -0.25, 1.0], [0.0, 2.0, -1.5]]
    assert embeddings.unpack(pack_vectors(vectors)) == vectors
    req = embeddings.parse({"model": "e", "input": ["a", "b"], "encoding_format": "base64"})
    out = embeddings.body(req, vectors, 7)
    decoded = array("f")
    decoded.frombytes(base64.b64decode(out["data"][1]["embedding"]))
    assert decoded.tolist() == vectors[1] and out["usage"] == {"prompt_tokens": 7,
                                                               "total_tokens": 7}


def test_simulated_embeddings_are_deterministic_and_shortenable() -> None:
    async def go() -> tuple[Any, Any, Any]:
        engine = SimulatedEngine(SimConfig(kv_cache_tokens=4096, max_model_len=2048,
                                           embedding_dim=64))
        await engine.start()
        try:
            ids = [TOK.encode("the gateway"), TOK.encode("the gateway queues")]
            a = await engine.embed("x", ids)
            b = await engine.embed("y", ids[:1], dimensions=16)
            return a, b, await engine.embed("z", ids[:1])
        finally:
            await engine.stop()

    full, short, again = asyncio.run(go())
    assert len(full) == 2 and len(full[0]) == 64 and len(short[0]) == 16
    assert again[0] == full[0]
    assert abs(sum(x * x for x in short[0]) - 1) < 1e-9
