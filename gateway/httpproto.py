"""uvicorn's httptools protocol with a deadline on request headers (slow-loris).

uvicorn bounds the idle time between requests (``--timeout-keep-alive``) but not the time a
client takes to send a request's headers: the keep-alive timer is cancelled by the first byte
that arrives, and a new connection has no timer at all. A client could open connections and
send a header line a minute, holding sockets and parser state forever. Here every connection
must complete each request's headers within ``HEADER_READ_TIMEOUT_S`` (setting, default 10 s) of
connecting or of its previous response, or it is closed. The body has its own deadline
(``BODY_READ_TIMEOUT_S``, ``gateway.inference.bodylimit``). Run uvicorn with
``--http gateway.httpproto:BoundedHttpToolsProtocol`` (``tests/procs.py``, ``manage.py serve``).

The same class tells the application when uvicorn's graceful shutdown begins
(``gateway.shutdown``), so open streams end with a retryable error instead of holding the
shutdown until their clients leave.
"""

from __future__ import annotations

import asyncio

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway import shutdown

PROTOCOL = "gateway.httpproto:BoundedHttpToolsProtocol"


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_headers_complete(self) -> None:
        self._disarm_header_deadline()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline()  # the next request's headers get the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        # uvicorn calls this on every open connection when its graceful shutdown begins.
        shutdown.begin()
        super().shutdown()

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(settings.HEADER_READ_TIMEOUT_S,
                                                     self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        busy = self.cycle is not None and not self.cycle.response_complete
        if not busy and not self.transport.is_closing():  # a pipelined request is running
            self.transport.close()
