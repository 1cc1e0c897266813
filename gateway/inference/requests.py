"""Request bodies -> typed, validated requests, or an OpenAI-shaped 400.

Parsing is strict on purpose: a field with the wrong type, a value out of range or a parameter
we do not implement is refused before anything is charged, rather than silently ignored (a
client asking for ``audio`` must learn it did not get it). Fields sent as ``null`` mean "not
given", as in OpenAI's API. Whether the chosen backend can honour a parameter is checked after
routing (``gateway.inference.capabilities``); tools and response formats are checked here
(``gateway.inference.tools``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from gateway.inference.errors import (
    ApiError,
    invalid_request,
    unknown_parameter,
    unsupported_value,
)
from gateway.inference.tools import (
    ResponseFormat,
    ToolChoice,
    parse_response_format,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
)

# Largest value accepted for any token count before the tenant's own limits are applied, so a
# number that could overflow a Redis counter or a C int never reaches the accounting scripts.
MAX_TOKENS_CEILING = 2**31 - 1
MAX_STOP_SEQUENCES = 4
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_N = 16  # choices per request (each is a sequence on the engine)
MAX_TOP_LOGPROBS = 20  # chat; legacy completions allow 5, as OpenAI's API does
MAX_COMPLETION_LOGPROBS = 5
MAX_LOGIT_BIAS = 300  # entries

# Parameters OpenAI defines that we refuse rather than ignore (clients would get wrong results).
UNSUPPORTED = frozenset({
    "functions", "function_call", "audio", "modalities", "prediction",
    "reasoning_effort", "web_search_options", "echo", "best_of", "suffix", "verbosity",
})
COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "stop", "seed", "user", "stream",
    "safety_identifier", "prompt_cache_key",
    "stream_options", "n", "metadata", "store", "service_tier", "ignore_eos",
    "frequency_penalty", "presence_penalty", "logprobs", "logit_bias",
    # vLLM's extensions (the official client sends them with ``extra_body``).
    "repetition_penalty", "min_tokens",
    # Models to fall back to when the asked one cannot serve (LiteLLM's extra_body field).
    "fallbacks",
})
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "tools", "tool_choice",
                        "parallel_tool_calls", "response_format", "top_logprobs"}
COMPLETION_FIELDS = COMMON | {"prompt", "response_format"}

Kind = Literal["chat", "completion"]
NO_TOOLS = ToolChoice("none")


@dataclass(frozen=True)
class InferenceRequest:
    kind: Kind
    model: str
    # Chat: the messages as dicts for the chat template ({"role", "content"}, and for tool
    # calls "tool_calls" with parsed arguments, "tool_call_id"; as vLLM passes them).
    messages: tuple[dict[str, Any], ...] = ()
    # Completions: text, or token ids the client tokenized itself.
    prompt: str | tuple[int, ...] = ""
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    user: str | None = None
    # OpenAI's newer name for the end user (``tenants.budgets.end_user_of`` reads either).
    safety_identifier: str | None = None
    # A hint that requests sharing it share a prompt prefix. Caching stays inside the tenant's
    # own salt (I1): the key never widens the scope, so it is accepted and changes nothing
    # another tenant can see.
    prompt_cache_key: str | None = None
    stream: bool = False
    include_usage: bool = False
    # vLLM's extension (sent with the official client's ``extra_body``): generate max_tokens
    # tokens even past end-of-sequence. Benchmarks use it to get streams of a known length.
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # None: no logprobs. Chat: top_logprobs (0-20) when logprobs is true; completions: 0-5.
    logprobs: int | None = None
    # Chat: function tools in OpenAI's shape (what the chat template renders), and the choice.
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: ToolChoice = NO_TOOLS
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    fallbacks: tuple[str, ...] = ()

    @property
    def text_size(self) -> int:
        """Characters of prompt text, messages (their tool calls' arguments too) and tools:
        what tokenizing costs, and a lower bound on what the chat template renders."""
        size = sum(len(str(m.get("content") or "")) + _calls_size(m) for m in self.messages)
        return size + len(self.prompt) + sum(
            len(json.dumps(t, ensure_ascii=False, separators=(",", ":"))) for t in self.tools)


def _calls_size(message: dict[str, Any]) -> int:
    """Characters of an assistant message's tool calls (names and arguments), rendered and
    tokenized with the message."""
    size = 0
    for call in message.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            args = fn.get("arguments") or ""  # parsed to an object for the template
            size += len(str(fn.get("name") or "")) + (len(args) if isinstance(args, str) else len(
                json.dumps(args, ensure_ascii=False, separators=(",", ":"))))
    return size


def parse(body: bytes, kind: Kind) -> InferenceRequest:
    return parse_object(load_json_object(body), kind)


def parse_object(data: dict[str, Any], kind: Kind) -> InferenceRequest:
    allowed = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    fields = {k: v for k, v in data.items() if v is not None}
    _refuse_unknown(fields, allowed)
    stream = _bool(fields, "stream", False)
    tools = parse_tools(fields.get("tools")) if kind == "chat" else ()
    return InferenceRequest(
        kind=kind,
        model=_model(fields),
        messages=_messages(fields) if kind == "chat" else (),
        prompt=_prompt(fields) if kind == "completion" else "",
        max_tokens=_max_tokens(fields),
        temperature=_number(fields, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(fields, "top_p", 1.0, 0.0, 1.0),
        stop=_stop(fields),
        seed=_int(fields, "seed", None, -(2**63), 2**63 - 1),
        user=_string(fields, "user", max_len=256),
        safety_identifier=_string(fields, "safety_identifier", max_len=256),
        prompt_cache_key=_string(fields, "prompt_cache_key", max_len=256),
        stream=stream,
        include_usage=_include_usage(fields, stream),
        ignore_eos=_bool(fields, "ignore_eos", False),
        n=int(_int(fields, "n", 1, 1, MAX_N) or 1),
        presence_penalty=_number(fields, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(fields, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(fields, "repetition_penalty", 1.0, 0.01, 10.0),
        logit_bias=_logit_bias(fields),
        min_tokens=int(_int(fields, "min_tokens", 0, 0, MAX_TOKENS_CEILING) or 0),
        logprobs=_logprobs(fields, kind),
        tools=tools,
        tool_choice=parse_tool_choice(fields.get("tool_choice"), tools),
        parallel_tool_calls=_bool(fields, "parallel_tool_calls", True),
        response_format=parse_response_format(fields.get("response_format")),
        fallbacks=_fallbacks(fields),
    )


MAX_FALLBACKS = 4


def _fallbacks(fields: dict[str, Any]) -> tuple[str, ...]:
    value = fields.get("fallbacks", [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _type_error("fallbacks", "a list of model names")
    if len(value) > MAX_FALLBACKS:
        raise ApiError(400, f"fallbacks: at most {MAX_FALLBACKS} models.", param="fallbacks",
                       code="invalid_value")
    return tuple(dict.fromkeys(value))


_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def _logit_bias(fields: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    bias = fields.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise _type_error("logit_bias", f"an object of at most {MAX_LOGIT_BIAS} token ids")
    out = []
    for token, value in bias.items():
        # ASCII digits only, and few: "²".isdigit() is true and int() of 5,001 digits raises
        # (review 3, N12), both used to answer 500.
        if not _TOKEN_ID.fullmatch(str(token)) or int(token) >= 2**31:
            raise invalid_request(f"Invalid key in 'logit_bias': {str(token)[:40]!r} is not a "
                                  "token id.", param="logit_bias", code="invalid_value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -100 <= value <= 100:
            raise invalid_request(f"Invalid value in 'logit_bias' for token {token}: expected "
                                  "a number from -100 to 100.", param="logit_bias",
                                  code="invalid_value")
        out.append((int(token), float(value)))
    return tuple(sorted(out))


def _logprobs(fields: dict[str, Any], kind: Kind) -> int | None:
    if kind == "completion":
        return _int(fields, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    wanted = _bool(fields, "logprobs", False)
    top = _int(fields, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise invalid_request("'top_logprobs' requires 'logprobs' to be true.",
                              param="top_logprobs", code="invalid_value")
    return (top or 0) if wanted else None


def load_json_object(body: bytes) -> dict[str, Any]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid_request(
            "The request body is not valid UTF-8.", code="invalid_encoding"
        ) from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise invalid_request(
            f"We could not parse the JSON body of your request: {_short(exc)}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_json")
    return data


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _short(exc: Exception) -> str:
    return str(exc)[:200]


def _refuse_unknown(fields: dict[str, Any], allowed: frozenset[str]) -> None:
    for name in fields:
        if name in UNSUPPORTED:
            raise ApiError(
                400, f"The parameter `{name}` is not supported by this server.",
                param=name, code="unsupported_parameter",
            )
        if name not in allowed:
            raise unknown_parameter(name)


def _model(fields: dict[str, Any]) -> str:
    if "model" not in fields:
        raise invalid_request("you must provide a model parameter", param="model",
                              code="missing_required_parameter")
    model = fields["model"]
    if not isinstance(model, str) or not model or len(model) > 256:
        raise _type_error("model", "a non-empty string")
    return model


def _messages(fields: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    messages = fields.get("messages")
    if messages is None:
        raise invalid_request("Missing required parameter: 'messages'.", param="messages",
                              code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _type_error("messages", "a non-empty array of messages")
    return tuple(_message(i, m) for i, m in enumerate(messages))


MESSAGE_FIELDS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "refusal"},
    "tool": {"role", "content", "tool_call_id", "name"},
}


def _message(i: int, message: Any) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _type_error(param, "an object")
    message = {k: v for k, v in message.items() if v is not None}
    role = message.get("role")
    if "function_call" in message:
        raise ApiError(400, "The deprecated 'function_call' is not supported; use 'tool_calls'.",
                       param=f"{param}.function_call", code="unsupported_parameter")
    if role not in ROLES:
        raise invalid_request(
            f"Invalid value for '{param}.role': expected one of {', '.join(sorted(ROLES))}.",
            param=f"{param}.role", code="invalid_value",
        )
    extra = set(message) - MESSAGE_FIELDS[role]
    if extra:
        raise unknown_parameter(f"{param}.{sorted(extra)[0]}")
    calls = parse_tool_calls(f"{param}.tool_calls", message.get("tool_calls"))
    content = message.get("content")
    if content is None and not calls:
        raise invalid_request(f"Missing required parameter: '{param}.content'.",
                              param=f"{param}.content", code="missing_required_parameter")
    out: dict[str, Any] = {"role": role,
                           "content": "" if content is None else _content(param, content)}
    if message.get("name") is not None:
        out["name"] = _checked_text(f"{param}.name", message["name"])
    if calls:
        out["tool_calls"] = calls
    if role == "tool":
        if "tool_call_id" not in message:
            raise invalid_request(f"Missing required parameter: '{param}.tool_call_id'.",
                                  param=f"{param}.tool_call_id",
                                  code="missing_required_parameter")
        out["tool_call_id"] = _checked_text(f"{param}.tool_call_id", message["tool_call_id"])
    return out


def _content(param: str, content: Any) -> str:
    if isinstance(content, str):
        return _checked_text(f"{param}.content", content)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            where = f"{param}.content[{j}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(400, "Only text content parts are supported.", param=where,
                               code="unsupported_value")
            parts.append(_checked_text(f"{where}.text", part.get("text")))
        return "".join(parts)
    raise _type_error(f"{param}.content", "a string or an array of text parts")


def _checked_text(param: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _type_error(param, "a string")
    try:
        # JSON escapes can smuggle lone surrogates (\ud800) that no tokenizer can encode.
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid_request(f"'{param}' is not valid Unicode text.", param=param,
                              code="invalid_encoding") from None
    return value


def _prompt(fields: dict[str, Any]) -> str | tuple[int, ...]:
    prompt = fields.get("prompt")
    if prompt is None:
        raise invalid_request("Missing required parameter: 'prompt'.", param="prompt",
                              code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one is the same request
    if isinstance(prompt, str):
        return _checked_text("prompt", prompt)
    if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise unsupported_value("prompt", "Batched prompts are not supported; send one each.")
    raise _type_error("prompt", "a string or a non-empty array of token ids")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def _max_tokens(fields: dict[str, Any]) -> int | None:
    plain = _int(fields, "max_tokens", None, 1, MAX_TOKENS_CEILING)
    newer = _int(fields, "max_completion_tokens", None, 1, MAX_TOKENS_CEILING)
    if plain is not None and newer is not None and plain != newer:
        raise invalid_request("Give max_tokens or max_completion_tokens, not two different values.",
                              param="max_tokens", code="invalid_value")
    return newer if newer is not None else plain


def _stop(fields: dict[str, Any]) -> tuple[str, ...]:
    stop = fields.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES:
        raise _type_error("stop", f"a string or an array of at most {MAX_STOP_SEQUENCES} strings")
    checked = tuple(_checked_text("stop", s) for s in stops)
    if any(not s for s in checked):
        raise invalid_request("Stop sequences may not be empty.", param="stop",
                              code="invalid_value")
    return checked


def _include_usage(fields: dict[str, Any], stream: bool) -> bool:
    options = fields.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid_request("The 'stream_options' parameter is only allowed when 'stream' is "
                              "enabled.", param="stream_options", code="invalid_value")
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object")
    extra = set(options) - {"include_usage"}
    if extra:
        raise unknown_parameter(f"stream_options.{sorted(extra)[0]}")
    return _bool(options, "include_usage", False, param="stream_options.include_usage")


def _bool(fields: dict[str, Any], name: str, default: bool, *, param: str | None = None) -> bool:
    value = fields.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(param or name, "a boolean")
    return value


def _number(fields: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = fields.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(name, "a number")
    return float(_in_range(name, value, low, high))


def _int(fields: dict[str, Any], name: str, default: int | None, low: int, high: int) -> int | None:
    value = fields.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer")
    return int(_in_range(name, value, low, high))


def _in_range(name: str, value: float, low: float, high: float) -> float:
    if not low <= value <= high:
        raise invalid_request(
            f"Invalid '{name}': {value} is out of range; expected {low} to {high}.",
            param=name, code="invalid_value",
        )
    return value


def _string(fields: dict[str, Any], name: str, *, max_len: int) -> str | None:
    value = fields.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > max_len:
        raise _type_error(name, f"a string of at most {max_len} characters")
    return _checked_text(name, value)


def _type_error(param: str, expected: str) -> ApiError:
    return invalid_request(f"Invalid type for '{param}': expected {expected}.", param=param,
                           code="invalid_type")

