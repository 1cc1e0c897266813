"""Logs that stay readable at production rates.

Two kinds of noise are kept out of the server log:

- **Expected refusals.** A 401/403/404/405/429 is the API doing its job, not a fault: Django's
  ``django.request`` logger would write each one with the exception's traceback.
  ``ExpectedRefusals`` (a logging filter, installed in ``settings.LOGGING``) keeps one line and
  drops the traceback; a 5xx keeps it.
- **Repeated warnings.** A warning that can fire once per request (an upstream that counts
  tokens differently, say) is logged at most once per ``every_s`` per process by ``Repeated``,
  with the number of like events since the last line; every occurrence is counted, and the
  counts reach Redis (``metrics:log_repeats``, one field per event) in one pipelined HINCRBY per
  ``flush``, so ``/metrics`` shows them as ``igw_repeated_log_events_total{event}``.
  Workers flush on their heartbeat, so the counter lags by at most one heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from infra.redis_conn import key

EXPECTED_STATUSES = frozenset({401, 403, 404, 405, 429})


def counts_key() -> str:
    return key("metrics", "log_repeats")


class ExpectedRefusals(logging.Filter):
    """On ``django.request``: a refusal the API meant to give logs one line, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        if status in EXPECTED_STATUSES:
            record.exc_info = None
            record.exc_text = None
            record.stack_info = None
        return True


_lock = threading.Lock()
_unflushed: dict[str, int] = {}  # event -> occurrences not yet added to Redis


class Repeated:
    """One warning that may repeat per request: a line per ``every_s``, every occurrence counted."""

    def __init__(self, logger: logging.Logger, event: str, every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.event = event
        self.every_s = every_s
        self.clock = clock
        self._next = float("-inf")
        self._since_line = 0  # occurrences not logged since the last line

    def warning(self, msg: str, *args: Any) -> None:
        now = self.clock()
        with _lock:
            _unflushed[self.event] = _unflushed.get(self.event, 0) + 1
            if now < self._next:
                self._since_line += 1
                return
            self._next = now + self.every_s
            skipped, self._since_line = self._since_line, 0
        if skipped:
            msg += " (and %d more like this in the last %gs)"
            args = (*args, skipped, self.every_s)
        self.logger.warning(msg, *args)


def take_counts() -> dict[str, int]:
    """The occurrences counted since the last call (and forget them)."""
    with _lock:
        taken = dict(_unflushed)
        _unflushed.clear()
    return taken


def _give_back(counts: dict[str, int]) -> None:
    with _lock:
        for event, n in counts.items():
            _unflushed[event] = _unflushed.get(event, 0) + n


def flush(client: Any) -> None:
    """Add the counted occurrences to Redis (a sync client); kept for the next try on failure."""
    counts = take_counts()
    if not counts:
        return
    try:
        pipe = client.pipeline(transaction=False)
        for event, n in counts.items():
            pipe.hincrby(counts_key(), event, n)
        pipe.execute()
    except Exception:
        _give_back(counts)
        raise


async def aflush(client: Any) -> None:
    """``flush`` with an asyncio client."""
    counts = take_counts()
    if not counts:
        return
    try:
        pipe = client.pipeline(transaction=False)
        for event, n in counts.items():
            pipe.hincrby(counts_key(), event, n)
        await pipe.execute()
    except Exception:
        _give_back(counts)
        raise
