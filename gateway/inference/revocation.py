"""Ending running streams when their credential stops being valid (revoked key, expired key,
suspended tenant, deleted OIDC registration or certificate binding).

A stream is authenticated once, when it starts; a long generation would otherwise run on to
``[DONE]`` after its key was revoked. Every change to keys, tenants, tiers and quotas rewrites
the *auth epoch* in Redis (``tenants.auth``, ADR 0005). One watcher task per event loop reads
that key every ``POLL_S`` (one GET per gateway process, however many streams it relays); when it
changed, the credential of every stream not yet checked under the new epoch is authenticated
again, once per distinct credential (a thousand streams on one key cost one lookup). A stream
whose credential now fails with 401 or 403 is told so through its callback; the relay cancels
the generation (the worker settles the tokens generated so far) and ends the stream with an
error event. A lookup that cannot be made (503: the database is down) ends nothing: an outage
must not cut every stream, and nothing can be revoked while the database is down anyway.

Revocation therefore ends a stream within ``POLL_S`` plus one lookup, in every process.

Expiry changes no epoch: a key that expires mid-stream is a change in time, not in the
database. So a stream whose credential has an expiry (``Principal.expires_at``) is re-checked
once that time has passed, whatever the epoch (review 3, N11), and ends as a revoked one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import redis

from infra.redis_conn import get_async_redis
from tenants.auth import AuthError, _epoch_key, aauthenticate_request, headers_from_scope

log = logging.getLogger(__name__)

POLL_S = 0.25
_CREDENTIAL_HEADERS = ("authorization", "x-ssl-client-cert", "x-ssl-client-fingerprint")

OnRevoked = Callable[[AuthError], None]
Credential = tuple[tuple[tuple[str, str], ...], str | None]


@dataclass
class _Stream:
    credential: Credential
    on_revoked: OnRevoked
    checked_under: bytes | str | None = None  # redis-py types a GET's reply as either
    expires_at: float | None = None  # wall-clock seconds; re-checked once past, then cleared


@dataclass
class _Watch:
    streams: dict[int, _Stream] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None


_watches: dict[int, _Watch] = {}
_ids = itertools.count()


def credential_of(scope: Mapping[str, Any]) -> Credential:
    """What authenticated the request: the credential headers and the TCP peer (for mTLS)."""
    from django.conf import settings

    headers, peer = headers_from_scope(scope)
    names = {*_CREDENTIAL_HEADERS, settings.MTLS_CERT_HEADER.lower(),
             settings.MTLS_FINGERPRINT_HEADER.lower()}
    return tuple(sorted((k, v) for k, v in headers.items() if k in names)), peer


@contextlib.contextmanager
def watching(scope: Mapping[str, Any], on_revoked: OnRevoked,
             expires_at: datetime | None = None) -> Iterator[None]:
    """While inside, ``on_revoked(error)`` is called (once) if the credential stops working,
    including when ``expires_at`` (the credential's own expiry) passes."""
    loop = asyncio.get_running_loop()
    watch = _watches.setdefault(id(loop), _Watch())
    stream_id = next(_ids)
    watch.streams[stream_id] = _Stream(
        credential_of(scope), on_revoked,
        expires_at=expires_at.timestamp() if expires_at is not None else None)
    if watch.task is None or watch.task.done():
        watch.task = loop.create_task(_run(watch, id(loop)))
    try:
        yield
    finally:
        watch.streams.pop(stream_id, None)


async def _run(watch: _Watch, loop_id: int) -> None:
    client = get_async_redis()
    try:
        while watch.streams:
            await asyncio.sleep(POLL_S)
            try:
                epoch = await client.get(_epoch_key()) or b"-"
            except redis.RedisError:
                continue  # nothing changes while Redis is away; the auth cache TTL applies
            await _recheck(watch, epoch)
    except Exception:
        log.exception("stream revocation watcher failed; the next stream restarts it")
    finally:
        if _watches.get(loop_id) is watch and not watch.streams:
            del _watches[loop_id]


async def _recheck(watch: _Watch, epoch: bytes | str) -> None:
    now = time.time()
    due = [s for s in list(watch.streams.values())
           if s.checked_under != epoch or (s.expires_at is not None and now >= s.expires_at)]
    verdicts: dict[Credential, AuthError | None] = {}
    for stream in due:
        if stream.expires_at is not None and now >= stream.expires_at:
            stream.expires_at = None  # checked after its expiry: once is enough
        if stream.credential not in verdicts:
            verdicts[stream.credential] = await _verdict(stream.credential)
        stream.checked_under = epoch
        error = verdicts[stream.credential]
        if error is not None and error.status in (401, 403):
            stream.checked_under = b""  # never again: it is being ended
            try:
                stream.on_revoked(error)
            except Exception:
                log.exception("ending a revoked stream failed")


async def _verdict(credential: Credential) -> AuthError | None:
    headers, peer = credential
    try:
        await aauthenticate_request(dict(headers), peer)
    except AuthError as err:
        return err
    return None
