"""The simulated model's tool calls under ``tool_choice: "auto"`` (``workers.engine.simtools``):
the stated rule over the rendered prompt, and the engine writing the call in the syntax the
gateway's ``hermes`` parser reads."""

from __future__ import annotations

import json
import random

import jsonschema

from gateway.inference.toolparsers import parse_hermes
from serving.tokenization import load_tokenizer
from serving.wire import pack_sampling, unpack_sampling
from tests.test_sim_engine import generate_one, req
from workers.engine.base import SamplingParams
from workers.engine.simtools import last_message, name_parts, offered_tools, tool_call_text
from workers.engine.simulated import SimConfig

TOK = load_tokenizer(None)
CONFIG = SimConfig(kv_cache_tokens=8192, max_model_len=2048)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.\nAny city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "localTime", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def rendered(messages: list[dict], tools: list[dict] | None = None) -> str:
    return TOK.render_chat(messages, tools=tools)


def test_the_rule_reads_the_rendered_prompt() -> None:
    prompt = rendered(ASK, [TIME, WEATHER])
    assert [t["name"] for t in offered_tools(prompt)] == ["localTime", "get_weather"]
    assert last_message(prompt) == ("user", "What is the weather in Oslo?")
    assert name_parts("getWeather-now_in") == {"get", "weather", "now"}
    call = tool_call_text(prompt, random.Random(1))
    assert call is not None
    content, [parsed] = parse_hermes(call)
    assert not content and parsed.name == "get_weather"
    args = json.loads(parsed.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert args["city"] in {"What", "the", "weather", "Oslo"}  # the message's own words
    # The first offered tool the message names wins.
    both = rendered([{"role": "user", "content": "Local time and weather?"}], [WEATHER, TIME])
    _, [first] = parse_hermes(tool_call_text(both, random.Random(1)) or "")
    assert first.name == "get_weather"
    _, [other] = parse_hermes(tool_call_text(both.replace("get_weather", "get_rain"),
                                              random.Random(1)) or "")
    assert other.name == "localTime" and json.loads(other.arguments)["tz"] in ("UTC", "CET")


def test_no_call_without_a_named_tool_after_a_tool_result_or_with_an_odd_schema() -> None:
    assert tool_call_text(rendered([{"role": "user", "content": "Say hello."}], [WEATHER]),
                          random.Random(1)) is None
    assert tool_call_text(rendered(ASK), random.Random(1)) is None  # no tools offered
    answered = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]
    assert last_message(rendered(answered, [WEATHER]))[0] == "tool"  # type: ignore[index]
    assert tool_call_text(rendered(answered, [WEATHER]), random.Random(1)) is None
    patterned = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z]"}}}}}
    assert tool_call_text(rendered(ASK, [patterned]), random.Random(1)) is None


def test_the_engine_calls_only_when_the_gateway_allows_it() -> None:
    prompt = TOK.apply_chat_template(ASK, tools=[WEATHER])
    auto = generate_one(CONFIG, req("auto", prompt, max_tokens=200, may_call_tools=True))
    assert auto.deltas[-1].finish_reason == "stop"
    _, [call] = parse_hermes(auto.text)
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    again = generate_one(CONFIG, req("again", prompt, max_tokens=200, may_call_tools=True))
    assert again.text == auto.text  # deterministic for (seed, prompt)
    # tool_choice "none" (the flag unset): text, never the call syntax.
    none = generate_one(CONFIG, req("none", prompt, max_tokens=40, seed=3))
    assert "<tool_call>" not in none.text


def test_the_flag_crosses_the_wire_and_an_unknown_field_is_dropped() -> None:
    sp = SamplingParams(max_tokens=5, may_call_tools=True)
    assert unpack_sampling(pack_sampling(sp)) == sp
    newer = json.loads(pack_sampling(sp)) | {"a_field_from_a_newer_gateway": 1}
    assert unpack_sampling(json.dumps(newer)) == sp
    assert "may_call_tools" not in sp.non_default()  # no backend refuses it


def test_a_schema_the_sampler_cannot_walk_means_text_not_a_failure() -> None:
    for params in ({"type": "object", "properties": 5}, {"type": "array", "items": [1]},
                   {"$ref": "#/nowhere"}, {"anyOf": "x"}):
        broken = {"type": "function", "function": {"name": "get_weather",
                                                    "parameters": params}}
        assert tool_call_text(rendered(ASK, [broken]), random.Random(1)) is None, params
