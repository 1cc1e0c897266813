"""The simulated model's tool calls under ``tool_choice: "auto"`` (``workers.engine.simtools``):
the stated rule over the rendered prompt, and the engine writing the call in the syntax the
gateway's ``hermes`` parser reads."""

from __future__ import annotations

import json
import random

import jsonschema

from gateway.inference.toolparsers import parse_hermes
from serving.tokenization import load_tokenizer
from serving.wire import SamplingParams, pack_sampling, unpack_sampling
from tests.test_sim_engine import generate_one, req
from workers.engine.simtools import (
    last_message,
    name_parts,
    offered_tools,
    schema_in_prompt,
    tool_call_text,
)
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


# -- json_object: the schema the prompt holds ------------------------------------------------

JOKE = {"type": "object", "properties": {
    "setup": {"type": "string"}, "punchline": {"type": "string"},
    "rating": {"type": "integer", "minimum": 1, "maximum": 10}},
    "required": ["setup", "punchline", "rating"]}


def test_a_schema_in_the_prompt_is_found_fenced_or_bare() -> None:
    fenced = f"Answer in JSON.\n```json\n{json.dumps(JOKE, indent=2)}\n```\nThanks."
    assert schema_in_prompt(fenced) == JOKE
    # instructor's Mode.JSON: the schema inline, after prose; the type defaults to object.
    bare = {k: v for k, v in JOKE.items() if k != "type"}
    found = schema_in_prompt(f"match the following json_schema:\n\n{json.dumps(bare)}\n\nok")
    assert found == {**bare, "type": "object"}
    # An object without "properties" (a tool definition, an example) is not a schema.
    assert schema_in_prompt(rendered(ASK, [WEATHER])) is None
    assert schema_in_prompt('Return {"a": 1} as JSON.') is None
    assert schema_in_prompt("No braces here { at all") is None
    # A schema the sampler cannot honour is ignored (any object is written instead).
    assert schema_in_prompt(json.dumps({"properties": {"x": {"pattern": "^a"}}})) is None


def test_json_object_follows_the_schema_in_the_prompt() -> None:
    ask = [{"role": "system", "content": "Reply with JSON matching this schema:\n```\n"
            + json.dumps(JOKE) + "\n```"}, {"role": "user", "content": "Tell me a joke."}]
    prompt = TOK.apply_chat_template(ask)
    run = generate_one(CONFIG, req("joke", prompt, max_tokens=400, json_object=True))
    jsonschema.validate(json.loads(run.text), JOKE)
    plain = generate_one(CONFIG, req("plain", TOK.apply_chat_template(ASK), max_tokens=400,
                                     json_object=True))
    assert isinstance(json.loads(plain.text), dict)  # no schema in the prompt: any object
