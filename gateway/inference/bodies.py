"""Response and chunk JSON in OpenAI's shapes.

A whole (non-streaming) response is built once per request with ``json.dumps``. Stream chunks are
built per token, so they come from a template made once per request: the constant prefix and
suffix around the only part that changes, the JSON-escaped text (``json.dumps`` of a str is the
C encoder). This keeps per-token Python work to a few byte concatenations (MEASUREMENTS.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.inference.requests import Kind
from serving.submission import UsageInfo

_escape = json.encoder.encode_basestring_ascii  # the C escaper json.dumps uses for a str


@dataclass(frozen=True)
class UsageCounts:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def response_id(kind: Kind, request_id: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id


def completion_body(
    kind: Kind, request_id: str, created: int, model: str, text: str, finish_reason: str,
    usage: UsageCounts,
) -> dict[str, object]:
    if kind == "chat":
        choice: dict[str, object] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": response_id(kind, request_id),
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage.as_dict(),
        "system_fingerprint": None,
    }


def choices_body(kind: Kind, request_id: str, created: int, model: str,
                 choices: list[dict[str, object]], usage: UsageCounts) -> dict[str, object]:
    """A whole response with choices an ``Assembler`` built (tools, n > 1, logprobs)."""
    return {
        "id": response_id(kind, request_id),
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage.as_dict(),
        "system_fingerprint": None,
    }


class ChunkTemplate:
    """Stream chunks for one request; ``delta(text)`` costs one C-level escape and a join."""

    def __init__(self, kind: Kind, request_id: str, created: int, model: str,
                 include_usage: bool) -> None:
        self.kind = kind
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        head = json.dumps({
            "id": response_id(kind, request_id), "object": obj, "created": created,
            "model": model, "system_fingerprint": None,
        }, separators=(",", ":"))[:-1]
        self._head = head.encode()
        # With include_usage every chunk carries "usage": null and one last chunk carries it.
        self._tail = b',"usage":null}' if include_usage else b"}"
        if kind == "chat":
            self._text_prefix = self._head + b',"choices":[{"index":0,"delta":{"content":'
            self._text_suffix = b'},"logprobs":null,"finish_reason":null}]' + self._tail
        else:
            self._text_prefix = self._head + b',"choices":[{"index":0,"text":'
            self._text_suffix = b',"logprobs":null,"finish_reason":null}]' + self._tail

    def delta(self, text: str) -> bytes:
        # What json.dumps(text) returns, without its argument handling (once per token).
        return b"%s%s%s" % (self._text_prefix, _escape(text).encode(), self._text_suffix)

    def choice(self, choice: dict[str, object]) -> bytes:
        """A chunk with one choice object built elsewhere (``choices.Assembler``)."""
        body = json.dumps(choice, separators=(",", ":")).encode()
        return self._head + b',"choices":[' + body + b"]" + self._tail

    def role(self) -> bytes:
        """The chat stream's first chunk: the assistant role with empty content, as OpenAI does."""
        return (self._head + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                b'"logprobs":null,"finish_reason":null}]' + self._tail)

    def finish(self, finish_reason: str) -> bytes:
        reason = json.dumps(finish_reason).encode()
        if self.kind == "chat":
            choice = b'{"index":0,"delta":{},"logprobs":null,"finish_reason":' + reason + b"}"
        else:
            choice = b'{"index":0,"text":"","logprobs":null,"finish_reason":' + reason + b"}"
        return self._head + b',"choices":[' + choice + b"]" + self._tail

    def usage(self, usage: UsageCounts) -> bytes:
        body = json.dumps(usage.as_dict(), separators=(",", ":")).encode()
        return self._head + b',"choices":[],"usage":' + body + b"}"


def model_entries(names: list[str], created: Mapping[str, int],
                  owner: str) -> list[dict[str, object]]:
    """The /v1/models entries; the listing is ``{"object": "list", "data": entries}``."""
    return [{"id": name, "object": "model", "created": created.get(name, 0), "owned_by": owner}
            for name in names]


def dumps(data: Any) -> bytes:
    """A body as compact JSON bytes."""
    return json.dumps(data, separators=(",", ":")).encode()


def usage_counts(usage: UsageInfo) -> UsageCounts:
    """The serving core's usage as the counts a response reports."""
    return UsageCounts(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
