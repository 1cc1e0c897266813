"""``POST /v1/responses``: OpenAI's Responses API, stateless, on the chat completions path.

A Responses request is translated into the chat request it means (``instructions`` -> a system
message; ``input`` items -> messages, ``function_call`` items -> assistant tool calls,
``function_call_output`` -> tool messages; ``text.format`` -> ``response_format``; function
tools reshaped) and then runs exactly as a chat completion: the same parsing and refusals, the
same admission, scheduling and settlement. Only the answer differs: a ``response`` object, or
the Responses event stream (``response.created`` ... ``response.completed``), built from the
choice deltas the chat assembler makes.

Nothing is stored: ``previous_response_id`` is refused with a 400 (there is no stored response
to continue from), and ``store`` is accepted but keeps nothing.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from gateway.inference.bodies import UsageCounts, dumps
from gateway.inference.choices import Assembler
from gateway.inference.errors import ApiError, invalid_request, unknown_parameter

# Fields accepted and ignored (they change nothing a stateless gateway does).
IGNORED = frozenset({"metadata", "store", "truncation", "include", "reasoning", "service_tier",
                     "background", "stream_options"})
MAPPED = frozenset({"model", "input", "instructions", "tools", "tool_choice",
                    "parallel_tool_calls", "max_output_tokens", "temperature", "top_p", "stream",
                    "text", "user", "top_logprobs", "previous_response_id",
                    "safety_identifier", "prompt_cache_key"})
PASSED = ("temperature", "top_p", "stream", "user", "parallel_tool_calls", "safety_identifier",
          "prompt_cache_key")
FIELDS = IGNORED | MAPPED


def _type_error(param: str, expected: str) -> ApiError:
    return invalid_request(f"Invalid type for '{param}': expected {expected}.", param=param,
                           code="invalid_type")


def to_chat(data: dict[str, Any]) -> dict[str, Any]:
    """The chat completions body a Responses body means (validated again by the chat parser)."""
    fields = {k: v for k, v in data.items() if v is not None}
    for name in fields:
        if name not in FIELDS:
            raise unknown_parameter(name)
    if "previous_response_id" in fields:
        raise ApiError(400, "previous_response_id is not supported: this server stores no "
                       "responses. Send the whole conversation in 'input'.",
                       param="previous_response_id", code="unsupported_parameter")
    if fields.get("background"):
        raise ApiError(400, "Background responses are not supported.", param="background",
                       code="unsupported_parameter")
    chat: dict[str, Any] = {"model": fields.get("model")}
    messages: list[dict[str, Any]] = []
    if "instructions" in fields:
        if not isinstance(fields["instructions"], str):
            raise _type_error("instructions", "a string")
        messages.append({"role": "system", "content": fields["instructions"]})
    messages += _input_messages(fields.get("input"))
    chat["messages"] = messages
    for name in PASSED:
        if name in fields:
            chat[name] = fields[name]
    if "max_output_tokens" in fields:
        chat["max_completion_tokens"] = fields["max_output_tokens"]
    if "top_logprobs" in fields:
        chat["logprobs"] = True
        chat["top_logprobs"] = fields["top_logprobs"]
    if "tools" in fields:
        chat["tools"] = _tools(fields["tools"])
    if "tool_choice" in fields:
        chat["tool_choice"] = _tool_choice(fields["tool_choice"])
    fmt = _format(fields.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


def responses_param(param: str | None) -> str | None:
    """The Responses field a chat parser's error is about: the client sent ``input``, never
    ``messages``, so a 400 names what it sent (chat names it would not recognise mapped)."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    if param in ("max_completion_tokens", "max_tokens"):
        return "max_output_tokens"
    if param.startswith("response_format"):
        return "text.format" + param.removeprefix("response_format").removeprefix(
            ".json_schema")
    if param == "logprobs":
        return "top_logprobs"
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    if param.startswith("tool_choice.function."):
        return "tool_choice." + param.removeprefix("tool_choice.function.")
    return param


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise invalid_request("Missing required parameter: 'input'.", param="input",
                              code="missing_required_parameter")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _type_error("input", "a string or a non-empty array of input items")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise _type_error(param, "an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"),
                             "content": _content(param, item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str)
                             else _content(f"{param}.output", output)})
        elif kind == "reasoning":
            continue  # this server's models keep no reasoning items: nothing to replay
        else:
            raise ApiError(400, f"Input items of type {kind!r} are not supported.",
                           param=f"{param}.type", code="unsupported_value")
    return messages


def _content(param: str, content: Any) -> Any:
    if isinstance(content, str) or content is None:
        return content
    if not isinstance(content, list):
        raise _type_error(f"{param}.content", "a string or an array of content parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text",
                                                                    "text"):
            raise ApiError(400, "Only text content parts are supported.",
                           param=f"{param}.content[{j}]", code="unsupported_value")
        parts.append({"type": "text", "text": part.get("text")})
    return parts


def _tools(value: Any) -> Any:
    if not isinstance(value, list):
        raise _type_error("tools", "an array of tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ApiError(400, "Only tools of type 'function' are supported.",
                           param=f"tools[{i}].type", code="unsupported_value")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
              if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def _format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _type_error("text", "an object")
    if text.get("verbosity") is not None:
        raise ApiError(400, "The parameter `text.verbosity` is not supported by this server.",
                       param="text.verbosity", code="unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _type_error("text.format", "an object")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": fmt.get("type")}


# -- the answer -----------------------------------------------------------------------------------


def response_id(request_id: str) -> str:
    return "resp_" + request_id


def usage_body(usage: UsageCounts | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


class ResponseBuilder:
    """Chat choice deltas (from an ``Assembler``) -> Responses output items and events."""

    def __init__(self, request_id: str, model: str, data: dict[str, Any]) -> None:
        self.id = response_id(request_id)
        self.model = model
        self.data = data
        self.created = int(time.time())
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the text item being written
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self.finish: str | None = None

    def response(self, status: str, usage: UsageCounts | None = None) -> dict[str, Any]:
        d = self.data
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": self.items if status != "in_progress" else [],
            "instructions": d.get("instructions"), "max_output_tokens":
            d.get("max_output_tokens"), "temperature": d.get("temperature"),
            "top_p": d.get("top_p"), "tools": d.get("tools") or [],
            "tool_choice": d.get("tool_choice") or "auto",
            "parallel_tool_calls": d.get("parallel_tool_calls", True),
            "previous_response_id": None, "error": None, "incomplete_details": incomplete,
            "metadata": d.get("metadata") or {}, "store": False, "truncation": "disabled",
            "text": d.get("text") or {"format": {"type": "text"}},
            "usage": usage_body(usage), "user": d.get("user"),
            "safety_identifier": d.get("safety_identifier"),
            "prompt_cache_key": d.get("prompt_cache_key"),
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for choice in choices:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def _text(self, text: str) -> list[dict[str, Any]]:
        out = []
        if self.message is None:
            self.message = {"type": "message", "id": "msg_" + secrets.token_hex(12),
                            "status": "in_progress", "role": "assistant", "content": []}
            self.items.append(self.message)
            index = len(self.items) - 1
            out.append(self._event("response.output_item.added", output_index=index,
                                   item={**self.message, "content": []}))
            self.message["content"].append({"type": "output_text", "text": "",
                                            "annotations": [], "logprobs": []})
            out.append(self._event("response.content_part.added", item_id=self.message["id"],
                                   output_index=index, content_index=0,
                                   part={"type": "output_text", "text": "",
                                         "annotations": [], "logprobs": []}))
        part = self.message["content"][0]
        part["text"] += text
        out.append(self._event("response.output_text.delta", item_id=self.message["id"],
                               output_index=self.items.index(self.message), content_index=0,
                               delta=text, logprobs=[]))
        return out

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index = call["index"]
        fn = call.get("function") or {}
        out = []
        item = self.calls.get(index)
        if item is None:
            out += self._close_message()
            item = {"type": "function_call", "id": "fc_" + secrets.token_hex(12),
                    "call_id": call.get("id") or "call_" + secrets.token_hex(12),
                    "name": fn.get("name", ""), "arguments": "", "status": "in_progress"}
            self.calls[index] = item
            self.items.append(item)
            out.append(self._event("response.output_item.added",
                                   output_index=len(self.items) - 1, item=dict(item)))
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta",
                                   item_id=item["id"], output_index=self.items.index(item),
                                   delta=fn["arguments"]))
        return out

    def _close_message(self) -> list[dict[str, Any]]:
        if self.message is None or self.message["status"] == "completed":
            return []
        msg = self.message
        msg["status"] = "completed"
        index = self.items.index(msg)
        part = msg["content"][0]
        return [
            self._event("response.output_text.done", item_id=msg["id"], output_index=index,
                        content_index=0, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", item_id=msg["id"], output_index=index,
                        content_index=0, part=part),
            self._event("response.output_item.done", output_index=index, item=msg),
        ]

    def end(self, usage: UsageCounts) -> list[dict[str, Any]]:
        out = self._close_message()
        for item in self.calls.values():
            item["status"] = "completed"
            index = self.items.index(item)
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, arguments=item["arguments"],
                                   name=item["name"]))
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        status = "incomplete" if self.finish == "length" else "completed"
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        out.append(self._event(kind, response=self.response(status, usage)))
        return out

    def whole(self, asm: Assembler, usage: UsageCounts) -> dict[str, Any]:
        """The non-streaming response from a finished assembler's first choice."""
        [choice] = asm.choices()[:1]
        message = choice["message"]
        if message.get("content"):
            self._text(message["content"])
        for k, call in enumerate(message.get("tool_calls") or ()):
            self._call({"index": k, "id": call["id"], "function": call["function"]})
        self.finish = choice["finish_reason"]
        self.end(usage)
        status = "incomplete" if self.finish == "length" else "completed"
        return self.response(status, usage)


def sse_event(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + dumps(event) + b"\n\n"


def dumps_events(events: list[dict[str, Any]]) -> bytes:
    return b"".join(sse_event(e) for e in events)

