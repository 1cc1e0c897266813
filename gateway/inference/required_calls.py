"""``tool_choice: "required"`` output read as it is generated, so its calls stream.

Under ``required`` the model writes a JSON array of ``{"name": ..., "parameters": {...}}``
(``tools.constraint``; the grammar writes ``name`` first). OpenAI streams each call's name as
soon as it is known, then its arguments in fragments; a call cut by ``max_tokens`` has still
shown its name and the arguments written so far, and ends with ``finish_reason: "length"``.
This scanner reads the text a character at a time (a JSON depth counter that knows strings),
and reports, for each call object of the array, its name once complete and every new piece of
its ``parameters`` value. Text in another shape yields nothing, and the caller falls back to
parsing the whole output at the end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gateway.inference.toolparsers import ToolCall, new_call_id

HEADER = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"parameters"\s*:\s*')


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""  # the raw text of ``parameters`` so far
    done: bool = False


@dataclass
class RequiredCalls:
    text: str = ""
    calls: list[Call] = field(default_factory=list)
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _object_at: int | None = None  # where the current call object began
    _current: Call | None = None  # its call, once its name is known
    _args_at: int = 0  # where its parameters value begins

    def feed(self, chunk: str) -> list[tuple[int, str | None, str]]:
        """New text; returns ``(call index, name or None, arguments fragment)`` updates: a name
        is given once, with the call's first update."""
        updates: list[tuple[int, str | None, str]] = []
        start = len(self.text)
        self.text += chunk
        for pos in range(start, len(self.text)):
            self._step(pos, updates)
        self._grow(len(self.text), updates)
        return updates

    def _step(self, pos: int, updates: list[tuple[int, str | None, str]]) -> None:
        ch = self.text[pos]
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
            return
        if ch == '"':
            self._in_string = True
        elif ch in "[{":
            self._depth += 1
            if self._depth == 2 and ch == "{":
                self._object_at, self._current = pos, None
        elif ch in "]}":
            self._depth -= 1
            if self._depth == 2:  # a value inside a call object closed: its parameters
                self._grow(pos + 1, updates)
                if self._current is not None:
                    self._current.done = True
            elif self._depth == 1:
                self._object_at = None

    def _grow(self, upto: int, updates: list[tuple[int, str | None, str]]) -> None:
        if self._object_at is None:
            return
        if self._current is None:
            match = HEADER.match(self.text, self._object_at)
            if match is None or match.end() >= upto:
                return  # the name, or the first character of its arguments, is still to come
            self._current = Call(new_call_id(), match.group(1))
            self._args_at = match.end()
            self.calls.append(self._current)
            updates.append((len(self.calls) - 1, self._current.name, ""))
        call = self._current
        if call.done:
            return
        piece = self.text[self._args_at + len(call.arguments):upto]
        if piece:
            call.arguments += piece
            updates.append((len(self.calls) - 1, None, piece))

    def tool_calls(self) -> list[ToolCall]:
        """The calls seen so far, the last one possibly cut short."""
        return [ToolCall(c.id, c.name, c.arguments) for c in self.calls]
