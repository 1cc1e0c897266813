"""Function tools and response formats: validating them, and what they ask of decoding.

Request side: ``tools``, ``tool_choice``, assistant ``tool_calls`` and ``response_format`` in
OpenAI's shapes, checked into plain values. Decoding side (``constraint``): what the engine must
be held to, as vLLM's OpenAI server does it:

- ``tool_choice`` naming a function: the output is that function's arguments, so decoding is
  constrained to its ``parameters`` schema;
- ``required``: the output is a JSON array of ``{"name", "parameters"}`` calls, one of the
  tools each (at most one when ``parallel_tool_calls`` is false);
- ``auto``: free text; the model's own tool-call format is parsed from it
  (``gateway.inference.toolparsers``, picked per served model);
- ``response_format``: ``json_schema`` (its ``schema``) or ``json_object`` (any object).

A forced tool choice wins over a response format, as in OpenAI's API.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from gateway.inference.errors import ApiError, invalid_request, unknown_parameter

MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

Mode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True)
class ToolChoice:
    mode: Mode
    name: str | None = None  # the function, when mode is "function"


@dataclass(frozen=True)
class ResponseFormat:
    type: Literal["text", "json_object", "json_schema"]
    schema: str | None = None  # JSON text of the schema (json_schema)
    name: str | None = None
    strict: bool = False


@dataclass(frozen=True)
class Constraint:
    """What decoding is held to: a JSON schema (JSON text), any JSON object, or nothing."""

    json_schema: str | None = None
    json_object: bool = False


def _type_error(param: str, expected: str) -> ApiError:
    return invalid_request(f"Invalid type for '{param}': expected {expected}.", param=param,
                           code="invalid_type")


def _schema(param: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _type_error(param, "a JSON schema object")
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, RecursionError):
        raise invalid_request(f"'{param}' is not a valid JSON schema.", param=param,
                              code="invalid_value") from None
    return value


def parse_tools(value: Any) -> tuple[dict[str, Any], ...]:
    """Function tools, normalised to {"type": "function", "function": {...}}."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise _type_error("tools", f"an array of at most {MAX_TOOLS} tools")
    # An empty list means no tools, as in OpenAI's API (the Agents SDK sends one for every
    # agent without tools).
    tools = []
    seen: set[str] = set()
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _type_error(param, "an object")
        if tool.get("type") != "function":
            raise ApiError(400, "Only tools of type 'function' are supported.",
                           param=f"{param}.type", code="unsupported_value")
        extra = set(tool) - {"type", "function"}
        if extra:
            raise unknown_parameter(f"{param}.{sorted(extra)[0]}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _type_error(f"{param}.function", "an object")
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra:
            raise unknown_parameter(f"{param}.function.{sorted(extra)[0]}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise invalid_request(
                f"Invalid '{param}.function.name': expected 1-64 letters, digits, _ or -.",
                param=f"{param}.function.name", code="invalid_value")
        if name in seen:
            raise invalid_request(f"Duplicate tool name {name!r}.",
                                  param=f"{param}.function.name", code="invalid_value")
        seen.add(name)
        out: dict[str, Any] = {"name": name}
        if fn.get("description") is not None:
            if not isinstance(fn["description"], str):
                raise _type_error(f"{param}.function.description", "a string")
            out["description"] = fn["description"]
        if fn.get("parameters") is not None:
            out["parameters"] = _schema(f"{param}.function.parameters", fn["parameters"])
        if fn.get("strict") is not None:
            if not isinstance(fn["strict"], bool):
                raise _type_error(f"{param}.function.strict", "a boolean")
            out["strict"] = fn["strict"]
        tools.append({"type": "function", "function": out})
    return tuple(tools)


def parse_tool_choice(value: Any, tools: tuple[dict[str, Any], ...]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value == "auto" and not tools:
            return ToolChoice("none")  # "auto" over no tools (``tools: []``) calls nothing
        if value == "required" and not tools:
            raise invalid_request(f"tool_choice '{value}' needs at least one tool in 'tools'.",
                                  param="tool_choice", code="invalid_value")
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise _type_error("tool_choice.function.name", "a string")
        if name not in {t["function"]["name"] for t in tools}:
            raise invalid_request(f"tool_choice names the function {name!r}, which is not in "
                                  "'tools'.", param="tool_choice", code="invalid_value")
        return ToolChoice("function", name)
    raise invalid_request("Invalid 'tool_choice': expected 'none', 'auto', 'required' or "
                          '{"type": "function", "function": {"name": ...}}.',
                          param="tool_choice", code="invalid_value")


def parse_tool_calls(param: str, value: Any) -> list[dict[str, Any]]:
    """An assistant message's tool calls, arguments parsed to objects for the chat template
    (templates render ``arguments | tojson``; vLLM parses them the same way)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _type_error(param, "an array of tool calls")
    calls = []
    for j, call in enumerate(value):
        where = f"{param}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise _type_error(where, 'an object {"id", "type": "function", "function"}')
        fn = call["function"]
        name, arguments = fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise _type_error(f"{where}.function.name", "a non-empty string")
        if not isinstance(arguments, str):
            raise _type_error(f"{where}.function.arguments", "a string of JSON")
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            parsed = arguments  # the model's own malformed output, replayed as it was
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise _type_error(f"{where}.id", "a string")
        calls.append({"id": call.get("id") or f"call_{j}", "type": "function",
                      "function": {"name": name, "arguments": parsed}})
    return calls


def parse_response_format(value: Any) -> ResponseFormat | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _type_error("response_format", "an object")
    kind = value.get("type")
    if kind in ("text", "json_object"):
        extra = set(value) - {"type"}
        if extra:
            raise unknown_parameter(f"response_format.{sorted(extra)[0]}")
        return None if kind == "text" else ResponseFormat("json_object")
    if kind != "json_schema":
        raise invalid_request("Invalid 'response_format.type': expected 'text', 'json_object' "
                              "or 'json_schema'.", param="response_format.type",
                              code="invalid_value")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _type_error("response_format.json_schema", "an object")
    extra = set(spec) - {"name", "schema", "strict", "description"}
    if extra:
        raise unknown_parameter(f"response_format.json_schema.{sorted(extra)[0]}")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid_request("Invalid 'response_format.json_schema.name': expected 1-64 "
                              "letters, digits, _ or -.", param="response_format.json_schema.name",
                              code="invalid_value")
    schema = _schema("response_format.json_schema.schema", spec.get("schema", {}))
    strict = spec.get("strict") or False
    if not isinstance(strict, bool):
        raise _type_error("response_format.json_schema.strict", "a boolean")
    return ResponseFormat("json_schema", json.dumps(schema, sort_keys=True), name, strict)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def constraint(tools: tuple[dict[str, Any], ...], choice: ToolChoice,
               parallel_tool_calls: bool, response_format: ResponseFormat | None) -> Constraint:
    """What decoding must be held to for this request (see the module docstring)."""
    if choice.mode == "function":
        tool = next(t for t in tools if t["function"]["name"] == choice.name)
        return Constraint(json.dumps(_parameters(tool), sort_keys=True))
    if choice.mode == "required":
        call = {"anyOf": [
            {"type": "object", "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _parameters(t)},
             "required": ["name", "parameters"], "additionalProperties": False}
            for t in tools]}
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": call}
        if not parallel_tool_calls:
            array["maxItems"] = 1
        return Constraint(json.dumps(array, sort_keys=True))
    if response_format is not None and response_format.type == "json_schema":
        return Constraint(response_format.schema)
    if response_format is not None and response_format.type == "json_object":
        return Constraint(json_object=True)
    return Constraint()
