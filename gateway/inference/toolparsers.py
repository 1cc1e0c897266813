"""Tool calls out of a model's text, in the formats its family was trained on.

A model asked to call tools (``tool_choice: auto``) writes its calls in its own syntax; a parser
named on the served model (``ServedModel.tool_call_parser``) turns them into OpenAI tool calls,
as vLLM's ``--tool-call-parser`` does:

- ``hermes`` (Qwen 2.5/3, Hermes, the simulated model): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, one block per call, after optional text;
- ``llama3_json`` (Llama 3.1-3.3): the whole output is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (v0.3 and
  earlier), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (tokenizer v11+).

``marker`` tells the stream relay where tool-call syntax may start, so it can stop streaming
that text as content and hold it until the calls can be parsed whole.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_PARSER = "hermes"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI returns it


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(new_call_id(), obj["name"], text)


def _json_values(text: str, separators: str = " \t\r\n") -> list[Any] | None:
    """Every JSON value in ``text`` (separated by ``separators``), or None if any is broken."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    i = 0
    while True:
        while i < len(text) and text[i] in separators:
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in HERMES.findall(text, start):
        values = _json_values(body)
        call = _call(values[0]) if values and len(values) == 1 else None
        if call is None:
            return text, []  # not well-formed: the text is the answer
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):]
    if not body.lstrip().startswith("{"):
        return text, []
    values = _json_values(body, " \t\r\n;")
    calls = [_call(v, "parameters") for v in values or ()]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, [c for c in calls if c is not None]


MISTRAL_V11 = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_-]+)\s*\[ARGS\]")


def parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    content = text[:start].strip() or None
    heads = list(MISTRAL_V11.finditer(text, start))
    if heads:
        calls = []
        for k, head in enumerate(heads):
            end = heads[k + 1].start() if k + 1 < len(heads) else len(text)
            values = _json_values(text[head.end():end])
            if not values or len(values) != 1:
                return text, []
            calls.append(ToolCall(new_call_id(), head.group(1),
                                  json.dumps(values[0], ensure_ascii=False)))
        return content, calls
    values = _json_values(text[start + len("[TOOL_CALLS]"):])
    items = values[0] if values and len(values) == 1 else None
    items = [items] if isinstance(items, dict) else items
    calls_or_none = [_call(v) for v in items] if isinstance(items, list) else [None]
    if not calls_or_none or any(c is None for c in calls_or_none):
        return text, []
    return content, [c for c in calls_or_none if c is not None]


@dataclass(frozen=True)
class ToolParser:
    name: str
    parse: Callable[[str], tuple[str | None, list[ToolCall]]]
    # Where tool-call syntax may begin: a marker anywhere, or (at_start) JSON at the start.
    marker: str
    at_start: bool = False

    def find(self, text: str) -> int | None:
        """Where tool-call syntax starts in ``text``, or None."""
        if self.at_start:
            stripped = text.lstrip()
            if stripped.startswith(("{", "<|python_tag|>")):
                return len(text) - len(stripped)
            return None
        i = text.find(self.marker)
        return i if i >= 0 else None

    def held(self, text: str) -> int:
        """How many trailing characters could still become the marker (keep them back)."""
        if self.at_start:
            return len(text) if not text.strip() else 0
        for k in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-k:]):
                return k
        return 0


PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser("hermes", parse_hermes, "<tool_call>"),
    "llama3_json": ToolParser("llama3_json", parse_llama3_json, "{", at_start=True),
    "mistral": ToolParser("mistral", parse_mistral, "[TOOL_CALLS]"),
}


def get_parser(name: str | None) -> ToolParser:
    return PARSERS.get(name or DEFAULT_PARSER, PARSERS[DEFAULT_PARSER])


def parse_required(text: str) -> list[ToolCall] | None:
    """``tool_choice: required`` output: a JSON array of {"name", "parameters"}."""
    values = _json_values(text)
    if not values or len(values) != 1 or not isinstance(values[0], list):
        return None
    calls = [_call(v, "parameters") for v in values[0]]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]
