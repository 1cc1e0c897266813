"""Send a request that reached the wrong cell to the tenant's home cell (docs/adr/0019).

Forwarded, not redirected: the official clients follow a 307/308 (httpx, follow_redirects), but
httpx drops the Authorization header when the redirect leaves the origin, so a cross-cell
redirect would arrive without its API key. The forward streams the home cell's answer back as
it comes (SSE included), so the tenant is admitted, charged and served only by a cell that
serves it; this cell's Redis and quota are never touched.

A request already forwarded once is never forwarded again: if the home cell disagrees (the
cells' settings differ), it answers 421 instead of looping.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from django.conf import settings

from gateway.inference.errors import ApiError, unavailable

log = logging.getLogger(__name__)

FORWARDED_HEADER = b"x-igw-forwarded-from"
CELL_HEADER = b"x-igw-cell"
# The request headers a cell forwards: what an OpenAI client sends, nothing hop-by-hop.
FORWARD_REQUEST = frozenset({
    b"authorization", b"content-type", b"accept", b"idempotency-key", b"last-event-id",
    b"openai-organization", b"openai-project", b"user-agent", b"x-stainless-retry-count",
})
# Set-Cookie: the home cell's cookies are for its own origin, never for this one's clients.
DROP_RESPONSE = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"server",
                           b"date", b"set-cookie"})
CONNECT_TIMEOUT_S = 5.0

_client: httpx.AsyncClient | None = None


class WrongCell(Exception):
    """This gateway's cell does not serve the tenant; ``url`` is its home cell's base URL."""

    def __init__(self, home: str, url: str) -> None:
        super().__init__(home)
        self.home, self.url = home, url


def check_cell(tenant_cells: tuple[str, ...], headers: list[tuple[bytes, bytes]]) -> None:
    """Raise WrongCell (or a 421) unless this process's cell serves a tenant with these cells."""
    here = settings.CELL
    if not here or not tenant_cells or here in tenant_cells:
        return
    home = tenant_cells[0]
    if any(k.lower() == FORWARDED_HEADER for k, _ in headers):
        raise ApiError(421, f"This request was forwarded to cell {here!r}, which does not serve "
                            f"this tenant either (home cell {home!r}); the cells' settings "
                            "disagree.", type="server_error", code="misdirected_request")
    target = settings.CELLS.get(home, {}).get("url")
    if not target:
        raise unavailable(f"This tenant is served in cell {home!r}, which is not configured "
                          "here.", retry_after=5, code="cell_unknown")
    raise WrongCell(home, target.rstrip("/"))


def _http() -> httpx.AsyncClient:
    global _client
    if _client is None:
        # No read timeout: a stream may pause as long as the home cell lets it.
        _client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                                    follow_redirects=False)
    return _client


Send = Callable[[dict[str, Any]], Awaitable[None]]


def forward_path(scope: dict[str, Any]) -> str:
    """The path and query to replay, as the client sent them (review 3).

    ``raw_path``, not the decoded ``path``: decoding would turn ``%3F`` into a query and ``%2F``
    into a segment at the home cell. A control character anywhere (``%0d%0a`` decoded, or
    raw) is refused with a 400 before anything is sent, so it can never reach a request line.
    """
    raw: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
    query: bytes = scope.get("query_string") or b""
    decoded = scope["path"].encode("utf-8", "surrogateescape")
    if any(b < 0x20 or b == 0x7F for b in raw + query + decoded):
        raise ApiError(400, "The request path contains a control character.", param="path",
                       code="invalid_path")
    text = raw.decode("latin-1")
    return text + ("?" + query.decode("latin-1") if query else "")


async def forward(scope: dict[str, Any], body: bytes, wrong: WrongCell, send: Send) -> None:
    """Replay the request at the home cell and stream its answer through ``send``.

    Nothing is sent before the home cell answers, so a connection failure is still a clean 503
    (retryable, and nothing was charged anywhere).
    """
    path = forward_path(scope)
    headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() in FORWARD_REQUEST]
    headers.append((FORWARDED_HEADER, settings.CELL.encode()))
    request = _http().build_request(scope["method"], wrong.url + path, headers=headers,
                                    content=body)
    try:
        response = await _http().send(request, stream=True)
    except httpx.HTTPError as exc:
        log.warning("forward to cell %s failed: %s", wrong.home, exc)
        raise unavailable(f"The tenant's home cell {wrong.home!r} is unreachable; retry.",
                          retry_after=2, code="cell_unreachable") from None
    try:
        raw = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in DROP_RESPONSE]
        raw.append((b"x-igw-forwarded-by", settings.CELL.encode()))
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": raw})
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        await response.aclose()
