"""The content-log write path, off the request path.

``enqueue_content`` (or ``aenqueue_content`` on the event loop) is what the inference layer
calls once a request has settled. It only acts for tenants that opted in; it seals the item with
the transit key (no plaintext in Redis) and pushes it onto ``contentlog:pending``. It never
raises: a failure is counted in ``contentlog:stats`` and the client never sees it.

``drain`` (the ``contentlog.drain`` Celery task, every 2 s) moves a batch to
``contentlog:processing``, re-checks the opt-in in the database, seals each item under the
tenant's DEK and inserts the batch. Invariants, as for the usage writer:

- an item is in ``pending``, in ``processing``, or in the table (or counted as dropped);
- only the lease holder claims or deletes, checked inside the Lua scripts;
- inserting is idempotent (unique tenant + request id), so a crash between commit and delete
  re-inserts nothing. A batch that fails to insert stays in ``processing`` and is retried by
  the next drain; every failure bumps ``write_failures``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import redis
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from gateway.contentlog import crypto, keys
from gateway.contentlog.models import ContentRecord
from infra.leased_queue import LeasedQueue
from infra.redis_conn import get_async_redis, get_redis, key, tag, text
from tenants.models import Tenant

log = logging.getLogger(__name__)

BATCH_SIZE = 200
LEASE_MS = 60_000

# KEYS: pending, stats   ARGV: item, max_pending
# Pushes unless the backlog is full, so a stuck drain can never grow Redis without bound.
_PUSH = """
if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[2]) then
  redis.call('HINCRBY', KEYS[2], 'dropped_backlog_full', 1)
  return 0
end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('HINCRBY', KEYS[2], 'enqueued', 1)
return 1
"""


# One hash tag for the whole queue: the push script and the leased queue's scripts each touch
# two or three of these keys, which must share a slot under Redis Cluster (ADR 0018).
_TAG = tag("q", "contentlog")


def pending_key() -> str:
    return key("contentlog", _TAG, "pending")


def processing_key() -> str:
    return key("contentlog", _TAG, "processing")


def lease_key() -> str:
    return key("contentlog", _TAG, "lease")


def stats_key() -> str:
    return key("contentlog", _TAG, "stats")


# --- enqueue (gateway process) ----------------------------------------------------------------

def _item(request_id: str, tenant_id: int, prompt: Any, response: Any) -> str:
    body = json.dumps({"prompt": prompt, "response": response}, separators=(",", ":"))
    kid, blob = crypto.seal_transit(tenant_id, request_id, body.encode())
    return json.dumps({"r": request_id, "t": tenant_id, "k": kid, "at": time.time(),
                       "c": base64.b64encode(blob).decode()})


def enqueue_content(request_id: str, tenant_id: int, prompt: Any, response: Any, *,
                    opted_in: bool | None = None) -> bool:
    """Queue one exchange for the content log. Never raises; True if queued.

    Pass ``opted_in=principal.content_logging`` from the inference layer (no lookup); without
    it the tenant's flag is read from the database (sync callers only).
    """
    try:
        if opted_in is None:
            opted_in = _opted_in(tenant_id)
        if not opted_in:
            return False
        item = _item(request_id, tenant_id, prompt, response)
        push = get_redis().register_script(_PUSH)  # runs by EVALSHA
        return bool(push(keys=[pending_key(), stats_key()],
                         args=[item, settings.CONTENT_LOG_MAX_PENDING]))
    except Exception as exc:  # content logging must never break inference
        _count_failure("enqueue_failures", exc)
        return False


async def aenqueue_content(request_id: str, tenant_id: int, prompt: Any, response: Any, *,
                           opted_in: bool) -> bool:
    """``enqueue_content`` for the event loop: one Redis round trip, never raises."""
    if not opted_in:
        return False
    try:
        item = _item(request_id, tenant_id, prompt, response)
        push = get_async_redis().register_script(_PUSH)  # runs by EVALSHA
        return bool(await push(keys=[pending_key(), stats_key()],
                               args=[item, settings.CONTENT_LOG_MAX_PENDING]))
    except Exception as exc:
        _count_failure("enqueue_failures", exc)
        return False


def _opted_in(tenant_id: int) -> bool:
    return Tenant.objects.filter(pk=tenant_id, content_logging=True).exists()


def _count_failure(field: str, exc: BaseException) -> None:
    log.warning("content log: %s (%s)", field, type(exc).__name__)
    with contextlib.suppress(redis.RedisError):
        get_redis().hincrby(stats_key(), field, 1)


def stats() -> dict[str, int]:
    """Counters: enqueued, written, write_failures, enqueue_failures, dropped_*."""
    raw = get_redis().hgetall(stats_key())
    return {text(k): int(v) for k, v in raw.items()}


# --- drain (Celery worker) --------------------------------------------------------------------

@dataclass
class DrainResult:
    claimed: int = 0
    written: int = 0
    dropped: int = 0


def drain(batch: int = BATCH_SIZE, now: datetime | None = None) -> DrainResult | None:
    """Write one batch. None if another drain holds the lease. Raises nothing it can count."""
    r = get_redis()
    queue = LeasedQueue(pending_key(), processing_key(), lease_key(), LEASE_MS)
    token = queue.acquire(r)
    if token is None:
        return None
    try:
        items = queue.claim(r, token, batch)
        result = DrainResult(claimed=len(items))
        if items:
            try:
                result.written, result.dropped = _write(items, now or timezone.now())
            except Exception as exc:  # stays in processing; the next drain retries it
                _count_failure("write_failures", exc)
                return result
            queue.release(r, token)
            _bump(r, written=result.written, dropped_unreadable=result.dropped)
        return result
    finally:
        queue.unlock(r, token)


def drain_all(now: datetime | None = None) -> int:
    """Drain until the backlog is empty (tests, the management shell)."""
    total = 0
    while (res := drain(now=now)) is not None and res.claimed:
        total += res.written
    return total


def _bump(r: redis.Redis, **counts: int) -> None:
    pipe = r.pipeline(transaction=False)
    for field, n in counts.items():
        if n:
            pipe.hincrby(stats_key(), field, n)
    pipe.execute()


def _write(items: Iterable[bytes], now: datetime) -> tuple[int, int]:
    decoded, unreadable = _decode(items)
    tenants = dict(
        Tenant.objects.filter(pk__in={d["t"] for d in decoded}, content_logging=True)
        .values_list("pk", "content_retention_days")
    )
    rows, deks = [], {}
    for d in decoded:
        if d["t"] not in tenants:
            unreadable += 1  # opted out (or deleted) since the request: do not keep it
            continue
        if d["t"] not in deks:  # one key lookup and unwrap per tenant per batch
            deks[d["t"]] = keys.active_key(d["t"])
        rows.append(_record(d, now, tenants[d["t"]], deks[d["t"]]))
    with transaction.atomic():
        ContentRecord.objects.bulk_create(rows, ignore_conflicts=True)
    return len(rows), unreadable


def _decode(items: Iterable[bytes]) -> tuple[list[dict[str, Any]], int]:
    out, bad = [], 0
    for raw in items:
        try:
            d = json.loads(raw)
            d["t"] = int(d["t"])
            d["plain"] = crypto.open_transit(d["k"], d["t"], d["r"], base64.b64decode(d["c"]))
            out.append(d)
        except Exception as exc:  # a poison item is dropped and counted, never retried forever
            log.error("content log: unreadable queued item dropped (%s)", type(exc).__name__)
            bad += 1
    return out, bad


def _record(d: dict[str, Any], now: datetime, retention_days: int,
            key: tuple[int, bytes]) -> ContentRecord:
    version, dek = key
    record_id = uuid.uuid4()
    created = now
    return ContentRecord(
        id=record_id, tenant_id=d["t"], request_id=str(d["r"])[:64], created_at=created,
        expires_at=created + timedelta(days=retention_days), key_version=version,
        ciphertext=crypto.seal_record(dek, d["t"], record_id, d["plain"]),
    )


def write_record(tenant_id: int, request_id: str, prompt: Any, response: Any,
                 now: datetime | None = None) -> ContentRecord:
    """Seal and insert one record synchronously (tests, backfills). Ignores the opt-in."""
    now = now or timezone.now()
    days = Tenant.objects.values_list("content_retention_days", flat=True).get(pk=tenant_id)
    body = json.dumps({"prompt": prompt, "response": response}).encode()
    record = _record({"t": tenant_id, "r": request_id, "plain": body}, now, days,
                     keys.active_key(tenant_id))
    record.save(force_insert=True)
    return record


def decrypt_record(record: ContentRecord) -> dict[str, Any]:
    """Open one record. Only ``breakglass.read_records`` may call this (it writes the audit)."""
    dek = keys.dek_for(record.tenant_id, record.key_version)
    body: dict[str, Any] = json.loads(
        crypto.open_record(dek, record.tenant_id, record.id, record.ciphertext))
    return body
