"""Server-sent events framing (WHATWG HTML, "Server-sent events").

Each event is ``id: <id>`` (so a client can resume with ``Last-Event-ID``) and one ``data:``
line, ended by a blank line. Our payloads are single-line JSON (``json.dumps`` never emits raw
newlines), so one ``data:`` line per event is always a correct frame. Comments (lines starting
with ``:``) keep idle connections open through proxies and are ignored by every client.
"""

from __future__ import annotations

import re

# A comment line with no blank line after it. The spec ignores a blank line that ends no data,
# but the official clients' decoders (openai's, httpx-sse's) dispatch an event there whenever a
# last event id is set, which ours always is after the first token: a blank line after the
# comment reached the openai SDK as an event with empty data, and it raised a JSONDecodeError
# mid-stream. The next event's own blank line ends it instead.
KEEPALIVE = b": keep-alive\n"
DONE = b"data: [DONE]\n\n"

HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # nginx and similar proxies buffer responses unless told not to, which would batch tokens.
    (b"x-accel-buffering", b"no"),
]


def event(data: bytes, event_id: str | None = None) -> bytes:
    if event_id is None:
        return b"data: " + data + b"\n\n"
    return b"id: " + event_id.encode() + b"\ndata: " + data + b"\n\n"


# Event ids are "<request id>/<stream entry id>": the request to re-attach to and where to resume.
RESUME_SEPARATOR = "/"
_ENTRY = re.compile(r"\d{1,20}-\d{1,20}")
_RID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def parse_resume_id(value: str | None) -> tuple[str, str] | None:
    """(request id, stream entry id) from a Last-Event-ID header, or None if it is not ours."""
    if not value:
        return None
    rid, sep, entry = value.strip().partition(RESUME_SEPARATOR)
    if not sep or not _RID.fullmatch(rid) or not _ENTRY.fullmatch(entry):
        return None
    return rid, entry
