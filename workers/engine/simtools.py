"""When the simulated model calls a tool on its own (``tool_choice: "auto"``), and with what.

A real model reads the tool definitions its chat template rendered and decides; the simulated
model follows one stated, deterministic rule over the same rendered prompt (the repo's
simulated chat template: a ``<tools>`` block of one JSON definition a line, then
``<|role|>``-tagged messages), so agent frameworks can run a real tool loop against it:

- it may call a tool only when the gateway says the output may be a tool call
  (``SamplingParams.may_call_tools``: ``tool_choice`` is ``auto`` and tools are offered);
- only when the last message is the user's (after a ``tool`` result it answers in text, so a
  loop ends);
- it calls the first offered tool whose name shares a word with that message: the name split on
  ``_``, ``-`` and camel case, parts of three letters or more, compared case-insensitively
  ("What is the weather in Oslo?" calls ``get_weather``);
- the arguments are a document valid against the tool's ``parameters`` schema, drawn by the
  guided sampler (``serving.guided``) with the message's own words as string content; a
  schema the sampler cannot honour means no call (it answers in text);
- the call is written in the template's (Hermes) syntax, which the gateway's ``hermes`` parser
  reads: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from serving.guided import SchemaError, check_schema, sample_json

ROLES = ("system", "user", "assistant", "tool")
GENERATION_PROMPT = "<|assistant|>\n"
_WORD = re.compile(r"[A-Za-z0-9]+")
_CAMEL = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def offered_tools(prompt: str) -> list[dict[str, Any]]:
    """The function definitions in the prompt's ``<tools>`` block (none: no block)."""
    start = prompt.find("<tools>\n")
    end = prompt.find("</tools>", start)
    if start < 0 or end < 0:
        return []
    tools = []
    for line in prompt[start + len("<tools>\n"):end].splitlines():
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            tools.append(fn)
    return tools


def last_message(prompt: str) -> tuple[str, str] | None:
    """(role, content) of the conversation's last message before the generation prompt."""
    body = prompt[: -len(GENERATION_PROMPT)] if prompt.endswith(GENERATION_PROMPT) else prompt
    found = max(((body.rfind(f"<|{role}|>\n"), role) for role in ROLES), default=(-1, ""))
    at, role = found
    if at < 0:
        return None
    content = body[at + len(f"<|{role}|>\n"):]
    return role, content.split("<|eos|>", 1)[0]


def name_parts(name: str) -> set[str]:
    return {p.lower() for chunk in re.split(r"[_\-\s]+", name) for p in _CAMEL.findall(chunk)
            if len(p) >= 3}


def tool_call_text(prompt: str, rng: random.Random) -> str | None:
    """The call the simulated model writes for this prompt, or None to answer in text."""
    tools = offered_tools(prompt)
    last = last_message(prompt) if tools else None
    if last is None or last[0] != "user":
        return None
    words = _WORD.findall(last[1])
    said = {w.lower() for w in words}
    for fn in tools:
        if not name_parts(fn["name"]) & said:
            continue
        schema = fn.get("parameters") or {"type": "object", "properties": {}}
        try:
            check_schema(schema)
            args = json.loads(sample_json(schema, rng, [w for w in words if len(w) >= 3]))
        except (SchemaError, ValueError, RecursionError, TypeError, AttributeError, KeyError,
                IndexError):
            # Any schema the sampler cannot walk (tool schemas are the client's, unchecked
            # under "auto"): no call, as a model that cannot fill the tool answers in text.
            return None
        return "<tool_call>" + json.dumps({"name": fn["name"], "arguments": args},
                                          ensure_ascii=False) + "</tool_call>"
    return None


# -- json_object: the schema a prompt asks for ------------------------------------------------
#
# A real model asked for ``json_object`` reads the prompt ("answer with a JSON object with the
# keys setup and punchline") and writes what it asks. The simulated model cannot read; it
# follows this rule instead: when the prompt holds a JSON Schema, in a fenced block or as a
# bare object with a ``properties`` object (LangChain's format instructions, instructor's
# Mode.JSON, the Vercel AI SDK's generateObject), the document it writes is valid against the
# first one found. Otherwise it writes any JSON object.

_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)```", re.DOTALL)
MAX_SCAN_CHARS = 20_000  # of the prompt's end, so a huge prompt costs a bounded scan
MAX_TRIES = 100  # candidate objects decoded at most


def _as_schema(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict) or not isinstance(value.get("properties"), dict):
        return None
    schema = value if "type" in value else {**value, "type": "object"}
    try:
        check_schema(schema)
    except (SchemaError, RecursionError, KeyError, ValueError):
        return None
    return schema


def schema_in_prompt(prompt: str) -> dict[str, Any] | None:
    """The first JSON Schema (an object with ``properties``) the prompt holds, fenced blocks
    first; None when there is none the sampler can honour."""
    text = prompt[-MAX_SCAN_CHARS:]
    for block in _FENCE.findall(text):
        try:
            found = _as_schema(json.loads(block))
        except (ValueError, RecursionError):
            continue
        if found is not None:
            return found
    decoder = json.JSONDecoder()
    at, tries = text.find("{"), 0
    while at >= 0 and tries < MAX_TRIES:
        tries += 1
        try:
            value, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            at = text.find("{", at + 1)
            continue
        found = _as_schema(value)
        if found is not None:
            return found
        at = text.find("{", end if isinstance(value, dict) and end > at else at + 1)
    return None
