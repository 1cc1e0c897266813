"""Tools, response formats and sampling parameters, unit by unit: request parsing, tool-call
parsers per model family, the choice assembler's whole and streamed shapes, the decoding
constraint, and which backend honours what."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.inference.choices import Assembler, needs_assembler
from gateway.inference.errors import ApiError
from gateway.inference.pools import ModelInfo, PoolInfo
from gateway.inference.requests import InferenceRequest, parse
from gateway.inference.sampling import check_supported, sampling_params
from gateway.inference.toolparsers import PARSERS, parse_required
from gateway.inference.tools import constraint
from serving.tokenization import load_tokenizer
from tenants.budgets import end_user_of

TOK = load_tokenizer(None)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}


def chat(**fields: Any) -> InferenceRequest:
    data = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse(json.dumps(data).encode(), "chat")


def refused(**fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        chat(**fields)
    return info.value


# -- request parsing ---------------------------------------------------------------------------


def test_tools_and_tool_choice_parse_to_plain_values() -> None:
    req = chat(tools=[WEATHER, TIME])
    assert req.tool_choice.mode == "auto" and len(req.tools) == 2
    named = chat(tools=[WEATHER, TIME],
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (named.tool_choice.mode, named.tool_choice.name) == ("function", "get_time")
    assert chat(tools=[WEATHER], tool_choice="none").tool_choice.mode == "none"
    assert chat().tool_choice.mode == "none"


def test_newer_openai_fields_safety_identifier_prompt_cache_key_and_verbosity() -> None:
    req = chat(safety_identifier="end-user-7", prompt_cache_key="k1", user="legacy")
    assert (req.safety_identifier, req.prompt_cache_key) == ("end-user-7", "k1")
    # The one end-user rule (budgets, usage, logs): the current name wins over the older one.
    assert end_user_of({"safety_identifier": "end-user-7", "user": "legacy"}, {}) == "end-user-7"
    assert end_user_of({"user": "legacy"}, {}) == "legacy" and end_user_of({}, {}) == ""
    err = refused(verbosity="low")
    assert (err.status, err.param, err.code) == (400, "verbosity", "unsupported_parameter")
    assert refused(safety_identifier=7).param == "safety_identifier"
    assert refused(prompt_cache_key="k" * 300).param == "prompt_cache_key"


def test_an_empty_tools_list_means_no_tools() -> None:
    """OpenAI accepts ``tools: []`` (the Agents SDK sends it for every agent without tools)."""
    for choice in (None, "auto", "none"):
        req = chat(tools=[], tool_choice=choice)
        assert req.tools == () and req.tool_choice.mode == "none"
    assert refused(tools=[], tool_choice="required").param == "tool_choice"


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {}, "extra": 1}}},
     "response_format.json_schema.extra"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                      "arguments": 3}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant"}]}, "messages[0].content"),
])
def test_bad_tools_and_formats_are_400_naming_the_field(fields: dict[str, Any],
                                                        param: str) -> None:
    err = refused(**fields)
    assert err.status == 400 and err.param == param


def test_a_tool_conversation_parses_for_the_template() -> None:
    req = chat(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    assistant, tool = req.messages[1], req.messages[2]
    assert assistant["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    rendered = TOK.render_chat(list(req.messages), tools=list(req.tools))
    assert '"name": "get_weather"' in rendered and "<tools>" in rendered
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' \
        in rendered
    assert "<|tool|>\nsunny" in rendered
    # The tool definitions are prompt tokens: counted (and charged) with the messages.
    assert len(TOK.apply_chat_template(list(req.messages), tools=list(req.tools))) > len(
        TOK.apply_chat_template(list(req.messages)))


def test_sampling_parameters_parse() -> None:
    req = chat(n=3, presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"17": 3, "5": -100},
               logprobs=True, top_logprobs=4, min_tokens=2, repetition_penalty=1.2, seed=4,
               max_completion_tokens=30)
    assert (req.n, req.presence_penalty, req.frequency_penalty) == (3, 0.5, -0.5)
    assert req.logit_bias == ((5, -100.0), (17, 3.0))
    assert (req.logprobs, req.min_tokens, req.repetition_penalty, req.max_tokens) == (
        4, 2, 1.2, 30)
    assert chat(logprobs=False).logprobs is None
    completion = parse(json.dumps({"model": "m", "prompt": "x", "logprobs": 2}).encode(),
                       "completion")
    assert completion.logprobs == 2


# -- the decoding constraint -------------------------------------------------------------------


def test_constraint_for_each_tool_choice_and_format() -> None:
    named = chat(tools=[WEATHER, TIME],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = constraint(named.tools, named.tool_choice, True, None)
    assert json.loads(c.json_schema) == WEATHER["function"]["parameters"]
    req = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(constraint(req.tools, req.tool_choice, False, None).json_schema)
    assert schema["type"] == "array" and (schema["minItems"], schema["maxItems"]) == (1, 1)
    assert [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]] == [
        ["get_weather"], ["get_time"]]
    fmt = chat(response_format={"type": "json_object"})
    assert constraint((), fmt.tool_choice, True, fmt.response_format).json_object
    assert constraint(req.tools, chat(tools=[WEATHER]).tool_choice, True, None).json_schema \
        is None


# -- tool-call parsers ---------------------------------------------------------------------------


def test_hermes_parser() -> None:
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call><tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}'
            "</tool_call>")
    content, calls = PARSERS["hermes"].parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert PARSERS["hermes"].parse("no tools here") == ("no tools here", [])
    broken = "<tool_call>{not json</tool_call>"
    assert PARSERS["hermes"].parse(broken) == (broken, [])


def test_llama3_json_parser() -> None:
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
            '{"name": "get_time", "parameters": {"tz": "UTC"}}')
    content, calls = PARSERS["llama3_json"].parse(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {"tz": "UTC"})]
    assert PARSERS["llama3_json"].parse("Hello {there}") == ("Hello {there}", [])


def test_mistral_parser_both_formats() -> None:
    old = 'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lima"}}]'
    content, calls = PARSERS["mistral"].parse(old)
    assert content == "Sure." and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Lima"}
    new = '[TOOL_CALLS]get_time[ARGS]{"tz": "PST"}[TOOL_CALLS]get_weather[ARGS]{"city": "X"}'
    _, calls = PARSERS["mistral"].parse(new)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"tz": "PST"}), ("get_weather", {"city": "X"})]


def test_required_output_parses_as_a_call_list() -> None:
    calls = parse_required('[{"name": "get_time", "parameters": {"tz": "UTC"}}]')
    assert calls is not None and calls[0].name == "get_time"
    assert json.loads(calls[0].arguments) == {"tz": "UTC"}
    assert parse_required('[{"name": "get_time", "param') is None


# -- the assembler: whole and streamed ----------------------------------------------------------


def stream(asm: Assembler, pieces: list[str], reason: str = "stop") -> list[dict[str, Any]]:
    out = []
    for piece in pieces:
        out += asm.feed(piece)
    return out + asm.finish(reason)


def assemble(req: InferenceRequest, framed: bool = False, parser: str = "hermes") -> Assembler:
    return Assembler(req, PARSERS[parser], TOK, framed)


def test_auto_tool_calls_stream_as_openai_deltas_and_hold_the_marker() -> None:
    req = chat(tools=[WEATHER])
    assert needs_assembler(req)
    pieces = ["Checking", " now. <tool", "_call>{\"name\": \"get_weather\", ",
              "\"arguments\": {\"city\": \"Oslo\"}}</tool_call>"]
    chunks = stream(assemble(req), pieces)
    content = "".join(c["delta"].get("content", "") for c in chunks)
    assert content == "Checking now. "  # the text before the call, never the marker
    calls = [c["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["delta"]]
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}
    assert chunks[-1] == {"index": 0, "delta": {}, "logprobs": None,
                          "finish_reason": "tool_calls"}
    whole = assemble(req)
    stream(whole, pieces)
    [choice] = whole.choices()
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking now."
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_auto_without_a_call_is_plain_text_even_with_a_partial_marker() -> None:
    req = chat(tools=[WEATHER])
    asm = assemble(req)
    chunks = stream(asm, ["a <tool", " b"], "length")
    assert "".join(c["delta"].get("content", "") for c in chunks) == "a <tool b"
    assert chunks[-1]["finish_reason"] == "length"
    assert asm.choices()[0]["message"] == {"role": "assistant", "content": "a <tool b",
                                           "refusal": None}


def test_named_function_streams_its_arguments() -> None:
    req = chat(tools=[WEATHER], tool_choice={"type": "function",
                                             "function": {"name": "get_weather"}})
    asm = assemble(req)
    chunks = stream(asm, ['{"city": ', '"Oslo"}'])
    calls = [c["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["delta"]]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Oslo"}'
    message = asm.choices()[0]["message"]
    assert message["content"] is None
    assert message["tool_calls"][0]["id"] == calls[0]["id"]
    assert asm.choices()[0]["finish_reason"] == "stop"  # as OpenAI answers a forced function


REQUIRED_OUT = ('[{"name": "get_weather", "parameters": {"city": "Os\\"lo", "n": {"a": [1]}}}, '
                '{"name": "get_time", "parameters": {"tz": "UTC"}}]')


def split(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 7, 500])
def test_required_calls_stream_name_first_then_argument_fragments(size: int) -> None:
    req = chat(tools=[WEATHER, TIME], tool_choice="required")
    asm = assemble(req)
    chunks = stream(asm, split(REQUIRED_OUT, size))
    deltas = [c["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["delta"]]
    headers = [d for d in deltas if "id" in d]
    assert [(d["index"], d["function"]["name"]) for d in headers] == [
        (0, "get_weather"), (1, "get_time")]
    parsed = parse_required(REQUIRED_OUT)
    assert parsed is not None
    for k, call in enumerate(parsed):
        args = "".join(d["function"]["arguments"] for d in deltas if d["index"] == k)
        assert json.loads(args) == json.loads(call.arguments)
        # The name goes out before any of its arguments.
        assert deltas.index(headers[k]) < min(i for i, d in enumerate(deltas)
                                              if d["index"] == k and d["function"]["arguments"])
    assert chunks[-1]["finish_reason"] == "tool_calls"
    whole = asm.choices()[0]
    assert [c["id"] for c in whole["message"]["tool_calls"]] == [h["id"] for h in headers]


def test_a_required_call_cut_by_max_tokens_shows_its_name_and_partial_arguments() -> None:
    req = chat(tools=[WEATHER, TIME], tool_choice="required")
    cut = '[{"name": "get_weather", "parameters": {"city": "Os'
    asm = assemble(req)
    chunks = stream(asm, split(cut, 1), "length")  # as the simulated tokenizer writes it
    deltas = [c["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["delta"]]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Os'
    assert chunks[-1]["finish_reason"] == "length"
    assert not any(c["delta"].get("content") for c in chunks)
    whole = assemble(req)
    stream(whole, [cut], "length")
    [choice] = whole.choices()
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Os'}
    # Cut before the name was complete: no call to show, the text is the content.
    early = assemble(req)
    stream(early, ['[{"name": "get_w'], "length")
    assert early.choices()[0]["message"]["content"] == '[{"name": "get_w'


def test_framed_choices_with_logprobs() -> None:
    req = chat(n=2, logprobs=True, top_logprobs=1)
    hello = TOK.encode("Hello")[0]
    frames = [json.dumps({"i": 1, "t": "Hello", "lp": [[hello, -0.5, [[hello, -0.5]]]]}),
              json.dumps({"i": 0, "t": "Hi", "lp": [[hello, -1.0, [[hello, -0.5]]]]}),
              json.dumps({"i": 0, "f": "stop"})]
    asm = assemble(req, framed=True)
    chunks = stream(asm, ["\n".join(frames) + "\n"], "length")
    assert {c["index"] for c in chunks} == {0, 1}
    whole = asm.choices()
    assert [c["finish_reason"] for c in whole] == ["stop", "length"]
    assert whole[1]["message"]["content"] == "Hello"
    lp = whole[0]["logprobs"]["content"][0]
    assert lp["logprob"] == -1.0 and lp["token"] == TOK.decode([hello])
    assert lp["bytes"] == list(lp["token"].encode())
    assert lp["top_logprobs"] == [{"token": lp["token"], "logprob": -0.5, "bytes": lp["bytes"]}]


def test_completion_logprobs_use_the_legacy_shape() -> None:
    req = parse(json.dumps({"model": "m", "prompt": "x", "logprobs": 1}).encode(), "completion")
    ids = TOK.encode("Hello world")
    asm = assemble(req, framed=True)
    asm.feed(json.dumps({"i": 0, "t": "Hello world", "lp": [[t, -0.1, [[t, -0.1]]]
                                                            for t in ids]}) + "\n")
    asm.finish("stop")
    lp = asm.choices()[0]["logprobs"]
    assert "".join(lp["tokens"]) == "Hello world"
    assert lp["token_logprobs"] == [-0.1] * len(ids)
    assert lp["text_offset"][0] == 0 and lp["text_offset"][-1] == len("Hello world") - len(
        lp["tokens"][-1])


# -- what each backend honours -------------------------------------------------------------------


def pool(backend: str, dialect: str = "") -> PoolInfo:
    return PoolInfo("p", "r", None, ModelInfo("m", None, 4096, 0), backend=backend,
                    dialect=dialect)


def test_backends_refuse_by_name_what_they_cannot_honour() -> None:
    req = chat(response_format={"type": "json_object"}, repetition_penalty=1.1)
    sp = sampling_params(req, 16)
    for backend in (pool("simulated"), pool("vllm"), pool("openai_upstream", "vllm")):
        check_supported(req, sp, backend)
    with pytest.raises(ApiError) as info:
        check_supported(req, sp, pool("openai_upstream", "openai"))
    assert info.value.param == "repetition_penalty"
    forced = chat(tools=[WEATHER], tool_choice="required")
    with pytest.raises(ApiError) as info:
        check_supported(forced, sampling_params(forced, 16), pool("openai_upstream", "llama_cpp"))
    assert info.value.param == "tool_choice" and info.value.code == "unsupported_parameter"


BACKENDS = {"sim": pool("simulated"), "vLLM": pool("vllm"),
            "up/vllm": pool("openai_upstream", "vllm"),
            "up/openai": pool("openai_upstream", "openai"),
            "up/llama.cpp": pool("openai_upstream", "llama_cpp")}
# The table in docs/openai-compatibility.md, row by row: (request, the parameter a refusal
# names, the backends that refuse it).
TABLE: list[tuple[dict[str, Any], str, set[str]]] = [
    ({"tools": [WEATHER]}, "tools", set()),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", {"up/openai",
                                                                       "up/llama.cpp"}),
    ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                          "function": {"name": "get_weather"}}},
     "tool_choice", {"up/openai", "up/llama.cpp"}),
    ({"response_format": {"type": "json_object"}}, "response_format",
     {"up/openai", "up/llama.cpp"}),
    ({"logprobs": True, "top_logprobs": 2}, "top_logprobs", {"up/openai"}),
    ({"logprobs": True}, "logprobs", {"up/openai"}),
    ({"presence_penalty": 0.5, "frequency_penalty": 0.5}, "presence_penalty", set()),
    ({"logit_bias": {"5": 3}}, "logit_bias", {"up/llama.cpp"}),
    ({"repetition_penalty": 1.1}, "repetition_penalty", {"up/openai", "up/llama.cpp"}),
    ({"min_tokens": 2}, "min_tokens", {"up/openai", "up/llama.cpp"}),
    ({"ignore_eos": True}, "ignore_eos", {"up/openai", "up/llama.cpp"}),
    ({"n": 3, "seed": 4, "stop": ["x"]}, "n", set()),
]


@pytest.mark.parametrize(("fields", "param", "refused"), TABLE)
def test_the_per_backend_table_is_what_the_code_does(fields: dict[str, Any], param: str,
                                                     refused: set[str]) -> None:
    req = chat(**fields)
    sp = sampling_params(req, 16)
    for name, backend in BACKENDS.items():
        if name not in refused:
            check_supported(req, sp, backend)
            continue
        with pytest.raises(ApiError) as info:
            check_supported(req, sp, backend)
        assert (info.value.status, info.value.param, info.value.code) == (
            400, param, "unsupported_parameter"), name
        assert f"`{param}`" in info.value.message


def test_simulated_backend_refuses_a_pattern_it_cannot_decode() -> None:
    req = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "^a+$"}}})
    with pytest.raises(ApiError) as info:
        check_supported(req, sampling_params(req, 16), pool("simulated"))
    assert info.value.param == "response_format" and "pattern" in info.value.message
