"""The auth epoch as this process last read it, so authenticating a request costs no Redis read.

The epoch (``tenants.auth``, ADR 0005) is rewritten on every change to keys, tenants, tiers and
quotas; a cached principal is used only under the epoch it was loaded with. Reading it from
Redis on every request was one of a request's round trips (issue 30). Instead, one daemon
thread per process keeps the last value:

- it subscribes to ``auth:epoch-changed`` (``tenants.auth._publish_epoch`` publishes there
  after writing the key) and reads the key again as soon as a message comes, so a revocation
  made by any process reaches every gateway within one pub/sub delivery and one GET;
- it reads the key at least every ``POLL_S`` whatever happens, so a message lost while its
  connection was down (or a Redis Cluster, where it does not subscribe) delays a revocation by
  ``POLL_S`` at most, never more: the guarantee the per-request read gave, within ``POLL_S``;
- a reading older than ``FRESH_S`` (the thread is stuck: Redis away) is not used: the caller
  reads the key itself, as before, and fails closed the same way when it cannot.

This process's own changes are seen at once (``changed_here``). A reading that began before
such a change is dropped, so the value never goes back to the epoch before it.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from infra.redis_conn import cluster_mode, get_redis, key

log = logging.getLogger(__name__)

POLL_S = 0.1
FRESH_S = 1.0

_lock = threading.Lock()
_value: tuple[bytes, float] | None = None  # the epoch, and when it was read (monotonic)
_generation = 0  # bumped by this process's own changes: a reading begun before one is dropped
_owner_pid = 0
_thread: threading.Thread | None = None


def epoch_key() -> str:
    return key("auth", "epoch")


def channel() -> str:
    # A channel, not a key: Redis Cluster delivers a PUBLISH to the subscribers on every node.
    return key("auth", "epoch-changed")


def current() -> bytes | None:
    """The epoch read within ``FRESH_S``, or None: then the caller reads it itself."""
    _ensure_watcher()
    seen = _value
    if seen is None or time.monotonic() - seen[1] > FRESH_S:
        return None
    return seen[0]


def changed_here(value: bytes) -> None:
    """This process wrote a new epoch: use it from now on, whatever a reading in flight says."""
    global _value, _generation
    with _lock:
        _generation += 1
        _value = (value, time.monotonic())


def forget() -> None:
    """Drop the reading (tests that empty Redis); the next one comes within ``POLL_S``."""
    global _value, _generation
    with _lock:
        _generation += 1
        _value = None


def _store(value: bytes, generation: int) -> None:
    global _value
    with _lock:
        if generation == _generation:
            _value = (value, time.monotonic())


def _ensure_watcher() -> None:
    """One watcher per process: after a fork the child's copy of the thread is not running."""
    global _thread, _owner_pid
    if _thread is not None and _owner_pid == os.getpid() and _thread.is_alive():
        return
    with _lock:
        if _thread is not None and _owner_pid == os.getpid() and _thread.is_alive():
            return
        _owner_pid = os.getpid()
        _thread = threading.Thread(target=_run, name="auth-epoch", daemon=True)
        _thread.start()


def _run() -> None:
    while True:
        try:
            _watch()
        except Exception as exc:  # Redis away: readings age past FRESH_S, callers read it
            log.debug("auth epoch watcher: %s; starting again", type(exc).__name__)
            time.sleep(POLL_S)


def _watch() -> None:
    client = get_redis()
    pubsub = None if cluster_mode() else \
        client.pubsub(ignore_subscribe_messages=True)
    try:
        if pubsub is not None:
            pubsub.subscribe(channel())  # before the first read: no change falls in between
        while True:
            generation = _generation
            raw = client.get(epoch_key())
            value = raw.encode() if isinstance(raw, str) else raw
            _store(value or b"-", generation)
            if pubsub is not None:
                pubsub.get_message(timeout=POLL_S)  # returns at once when the epoch changed
            else:
                time.sleep(POLL_S)
    finally:
        if pubsub is not None:
            pubsub.close()
