"""Choices of a response that needs more than relaying text: tools, n > 1, logprobs.

Plain requests take the per-token fast path (``bodies.ChunkTemplate``). These take this one:
the worker frames each choice's deltas (``workers.host.frame``: choice index, text, token ids
with logprobs, finish), and an ``Assembler`` turns them into OpenAI's choice objects, for a
stream (``feed``/``finish`` return the chunk choices to send now) and for a whole response
(``choices``).

Tool calls are held back while they are being written: content streams until the model's
tool-call syntax begins (``ToolParser.find``; a possible partial marker is kept back), then the
rest waits for the end, is parsed whole, and goes out as tool-call deltas in OpenAI's shape
(one delta with id, type, name and empty arguments, then the arguments). A call to a function
named in ``tool_choice`` streams its arguments as they are generated, since the whole output is
the arguments.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from gateway.inference.errors import ApiError
from gateway.inference.requests import InferenceRequest
from gateway.inference.required_calls import RequiredCalls
from gateway.inference.toolparsers import ToolCall, ToolParser, new_call_id, parse_required
from serving.tokenization import HFTokenizer

Choice = dict[str, Any]


class TokenText:
    """Token id -> (text, bytes) with the model's tokenizer, cached per process."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tok = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is None:
            table = self.tok.token_bytes
            if table is not None and 0 <= token_id < len(table):
                raw = table[token_id]
                hit = (raw.decode("utf-8", "replace"), list(raw))
            else:
                text = self.tok.decode([token_id], skip_special_tokens=False)
                hit = (text, list(text.encode()))
            self.cache[token_id] = hit
        return hit


class _Choice:
    def __init__(self, index: int) -> None:
        self.index = index
        self.parts: list[str] = []
        self.emitted = 0  # characters of the text sent as content
        self.tool_start: int | None = None
        self.call_id: str | None = None  # a named function's call, once its header went out
        self.lp: list[Any] = []  # logprob entries not yet sent (stream) / all (whole)
        self.lp_all: list[Any] = []
        self.finish: str | None = None
        self.calls: list[ToolCall] = []
        self.content: str | None = None
        self.scan = RequiredCalls()  # tool_choice "required": the calls as they are written

    @property
    def text(self) -> str:
        return "".join(self.parts)


class Assembler:
    def __init__(self, req: InferenceRequest, parser: ToolParser, tokenizer: HFTokenizer,
                 framed: bool) -> None:
        self.req = req
        self.chat = req.kind == "chat"
        self.mode = req.tool_choice.mode if self.chat else "none"
        self.parser = parser
        self.framed = framed
        self.token = TokenText(tokenizer)
        self.list = [_Choice(i) for i in range(req.n)]

    # -- input ------------------------------------------------------------------------------

    def _pieces(self, text: str) -> Iterator[tuple[int, str, list[Any] | None, str | None]]:
        if not self.framed:
            yield 0, text, None, None
            return
        for line in text.split("\n"):
            if line:
                try:
                    piece = json.loads(line)
                    yield int(piece["i"]), piece.get("t", ""), piece.get("lp"), piece.get("f")
                except (ValueError, KeyError, TypeError):
                    # Not a frame: a body declaring n or logprobs resumed a plain stream
                    # (review 3, N12). A 400 naming the parameter, not a 500.
                    name = "n" if self.req.n > 1 else "logprobs"
                    raise ApiError(400, f"The `{name}` of this body does not match the stream "
                                   "being resumed: resume with the original request.",
                                   param=name, code="invalid_value") from None

    def feed(self, text: str) -> list[Choice]:
        """A token event's text; returns the stream chunk choices to send now."""
        out: list[Choice] = []
        for i, t, lp, finish in self._pieces(text):
            if not 0 <= i < len(self.list):
                continue
            c = self.list[i]
            if c.finish is not None:
                continue
            if lp:
                entries = [self._logprob(e) for e in lp]
                c.lp += entries
                c.lp_all += entries
            if t:
                c.parts.append(t)
                out += self._progress(c)
            if finish is not None and finish in ("stop", "length"):
                out += self._end(c, finish)
        return out

    def finish(self, reason: str) -> list[Choice]:
        """The request's end: finish every choice that has not finished by itself."""
        out: list[Choice] = []
        for c in self.list:
            if c.finish is None:
                out += self._end(c, reason)
        return out

    # -- logprobs ---------------------------------------------------------------------------

    def _logprob(self, entry: list[Any]) -> Any:
        token_id, logprob, top = entry
        text, raw = self.token(int(token_id))
        if self.chat:
            return {"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": [
                {"token": self.token(int(t))[0], "logprob": lp, "bytes": self.token(int(t))[1]}
                for t, lp in top]}
        return (text, logprob, {self.token(int(t))[0]: lp for t, lp in top})

    def _logprobs(self, entries: list[Any], offset: int) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        offsets, pos = [], offset
        for text, _, _ in entries:
            offsets.append(pos)
            pos += len(text)
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": offsets}

    def _take_lp(self, c: _Choice, offset: int) -> dict[str, Any] | None:
        entries, c.lp = c.lp, []
        return self._logprobs(entries, offset)

    # -- streaming --------------------------------------------------------------------------

    def _delta(self, c: _Choice, delta: dict[str, Any], offset: int = 0,
               finish: str | None = None) -> Choice:
        lp = self._take_lp(c, offset)
        if self.chat:
            return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": c.index, "text": delta.get("content", ""), "logprobs": lp,
                "finish_reason": finish}

    def _content(self, c: _Choice, upto: int) -> list[Choice]:
        if upto <= c.emitted:
            return []
        start, c.emitted = c.emitted, upto
        return [self._delta(c, {"content": c.text[start:upto]}, start)]

    def _progress(self, c: _Choice) -> list[Choice]:
        if self.mode == "none":
            return self._content(c, len(c.text))
        if self.mode == "function":
            out = []
            if c.call_id is None:
                c.call_id = new_call_id()
                out.append(self._delta(c, {"tool_calls": [{
                    "index": 0, "id": c.call_id, "type": "function",
                    "function": {"name": self.req.tool_choice.name, "arguments": ""}}]}))
            out.append(self._delta(c, {"tool_calls": [{
                "index": 0, "function": {"arguments": c.parts[-1]}}]}))
            return out
        if self.mode == "required":
            return self._required(c, c.parts[-1])
        if c.tool_start is not None:
            return []  # held until the end
        text = c.text
        start = self.parser.find(text)
        if start is not None:
            c.tool_start = start
            return self._content(c, start)
        return self._content(c, len(text) - self.parser.held(text))

    def _required(self, c: _Choice, text: str) -> list[Choice]:
        """Each call's name as soon as it is written, then its argument fragments."""
        out = []
        for k, name, piece in c.scan.feed(text):
            if name is not None:
                out.append(self._delta(c, {"tool_calls": [{
                    "index": k, "id": c.scan.calls[k].id, "type": "function",
                    "function": {"name": name, "arguments": ""}}]}))
            if piece:
                out.append(self._delta(c, {"tool_calls": [{
                    "index": k, "function": {"arguments": piece}}]}))
        return out

    def _end(self, c: _Choice, reason: str) -> list[Choice]:
        self._resolve(c, reason)
        out: list[Choice] = []
        if self.mode == "function":
            if c.call_id is None:  # nothing was generated: an empty call still names it
                c.call_id = c.calls[0].id
                out.append(self._delta(c, {"tool_calls": [{
                    "index": 0, "id": c.call_id, "type": "function",
                    "function": {"name": self.req.tool_choice.name, "arguments": ""}}]}))
        elif c.calls:
            streamed = len(c.scan.calls)  # required calls already sent as they were written
            for k, call in enumerate(c.calls[streamed:], streamed):
                out.append(self._delta(c, {"tool_calls": [{
                    "index": k, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}}]}))
                out.append(self._delta(c, {"tool_calls": [{
                    "index": k, "function": {"arguments": call.arguments}}]}))
        else:
            out += self._content(c, len(c.text))
        assert c.finish is not None
        out.append(self._delta(c, {}, finish=c.finish))
        return out

    def _resolve(self, c: _Choice, reason: str) -> None:
        """The choice's final content, tool calls and finish reason."""
        text = c.text
        c.finish = reason
        if self.mode == "function":
            # As OpenAI does for a forced function: the call, and finish_reason "stop".
            c.calls = [ToolCall(c.call_id or new_call_id(), self.req.tool_choice.name or "",
                                text)]
            return
        if self.mode == "required":
            calls = self._required_calls(c, text)
        elif self.mode == "auto" and c.tool_start is not None:
            _, calls = self.parser.parse(text)
            if calls:
                # The content is what came before the calls (what a stream already sent).
                c.content = text[: c.tool_start].strip() or None
                c.calls = calls
                if reason == "stop":
                    c.finish = "tool_calls"
                return
        else:
            calls = None
        if calls:
            c.calls = calls
            if reason == "stop":
                c.finish = "tool_calls"
        else:
            c.calls = []
            c.content = text

    @staticmethod
    def _required_calls(c: _Choice, text: str) -> list[ToolCall] | None:
        """The whole output's calls, under the ids the stream used; when the output was cut
        (``max_tokens``), the calls as far as they were written."""
        seen = c.scan.calls
        parsed = parse_required(text)
        if parsed is None:
            return c.scan.tool_calls() or None
        ids = [s.id for s in seen] + [p.id for p in parsed[len(seen):]]
        return [ToolCall(i, p.name, p.arguments) for i, p in zip(ids, parsed, strict=False)]

    # -- whole responses --------------------------------------------------------------------

    def choices(self) -> list[Choice]:
        out = []
        for c in self.list:
            if c.finish is None:
                self._resolve(c, "stop")
            lp = self._logprobs(c.lp_all, 0)
            if not self.chat:
                out.append({"index": c.index, "text": c.text, "logprobs": lp,
                            "finish_reason": c.finish})
                continue
            message: dict[str, Any] = {"role": "assistant",
                                       "content": None if c.calls and not c.content
                                       else c.content if c.calls else c.text,
                                       "refusal": None}
            if c.calls:
                message["tool_calls"] = [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}
                    for call in c.calls]
            out.append({"index": c.index, "message": message, "logprobs": lp,
                        "finish_reason": c.finish})
        return out

    def role_chunks(self) -> list[Choice]:
        return [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None} for c in self.list]

    def texts(self) -> list[str]:
        return [c.text for c in self.list]


def needs_assembler(req: InferenceRequest) -> bool:
    """Whether a request leaves the plain per-token fast path."""
    return req.n > 1 or req.logprobs is not None or (
        req.kind == "chat" and req.tool_choice.mode != "none")


def framed(req: InferenceRequest) -> bool:
    """Whether the worker frames this request's stream (the same test as ``workers.host``)."""
    return req.n > 1 or req.logprobs is not None


def stream_shape(req: InferenceRequest) -> str:
    """What a stream's entries look like, kept with the request (``serving.submission``) so a
    resume can check that its body reads them the same way: ``n=2;logprobs=1;tools=0``."""
    tools = req.kind == "chat" and req.tool_choice.mode != "none"
    return f"n={req.n};logprobs={int(req.logprobs is not None)};tools={int(tools)}"


def check_resume_shape(req: InferenceRequest, stored: str) -> None:
    """A 400 naming the first of ``n``, ``logprobs``, ``tools`` in which the resuming body
    differs from the request that made the stream (review 3, N12): a plain stream read with a
    tool parser, or a framed one as text, would be garbled. A stream admitted before shapes
    were kept (``stored`` empty) is let through; ``Assembler._pieces`` still catches a framed
    body on a plain stream."""
    if not stored:
        return
    before = dict(part.split("=", 1) for part in stored.split(";") if "=" in part)
    now = dict(part.split("=", 1) for part in stream_shape(req).split(";"))
    for name in ("n", "logprobs", "tools"):
        if name in before and before[name] != now[name]:
            raise ApiError(400, f"The `{name}` of this body does not match the stream being "
                                "resumed: resume with the original request.",
                           param=name, code="invalid_value")
