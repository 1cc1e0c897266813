"""The tenants' request log: every request, admitted or refused, with counts and codes only.

Two sources, both off the request path:

- **Admitted requests** end in a usage record (settle.lua pushes it in the script that settles);
  the usage writer inserts their log entries in the same transaction as the usage rows
  (``entries_from_usage``), so a settled request has its entry exactly when it has its record.
- **Refused requests** (a 429, a 400 after authentication, a 404 model) are never admitted and
  so have no usage record: the gateway pushes one JSON line onto ``reqlog:{q.reqlog}:pending``
  (``arecord_refusal``: one RPUSH + LTRIM in one pipeline, no database on the request path),
  and the usage writer's run drains it under a lease (``flush_refusals``, the same leased queue
  as usage records: nothing lost or written twice, inserts idempotent on ``request_id``).
  The list keeps at most ``REQUEST_LOG_MAX_PENDING`` entries (the newest), so a client that
  hammers the API while the writer is down cannot grow Redis without bound.

Unauthenticated refusals (401) belong to no tenant and are not logged here. Entries older
than ``REQUEST_LOG_RETENTION_DAYS`` are deleted by ``purge`` (a periodic task).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction

from infra.leased_queue import LeasedQueue
from metering.keys import refusals_lease_key, refusals_pending_key, refusals_processing_key
from metering.models import RequestLogEntry, UsageRecord

log = logging.getLogger(__name__)

BATCH_SIZE = 500
LEASE_MS = 60_000
REFUSED = "refused"


def refusals_queue() -> LeasedQueue:
    return LeasedQueue(refusals_pending_key(), refusals_processing_key(), refusals_lease_key(),
                       LEASE_MS)


def context_of(data: Mapping[str, Any]) -> tuple[str, int | None]:
    """(end user, project id) as a usage record or a refusal carries them (both optional)."""
    end_user = data.get("end_user")
    project = data.get("project_id")
    return (str(end_user)[:256] if end_user else "",
            int(project) if project not in (None, "") else None)


def entries_from_usage(pairs: Iterable[tuple[UsageRecord, Mapping[str, Any]]]
                       ) -> list[RequestLogEntry]:
    """The log entries of a batch of settled requests (the usage writer's records)."""
    entries = []
    for rec, data in pairs:
        end_user, project = context_of(data)
        entries.append(RequestLogEntry(
            request_id=rec.request_id, at=rec.finished_at, tenant_id=rec.tenant_id,
            api_key_id=rec.api_key_id, project_id=project, end_user=end_user,
            model_name=rec.model_name, pool_name=rec.pool_name,
            http_status=200 if rec.status == UsageRecord.Status.OK else None,
            status=rec.status, error_code=rec.error_code, prompt_tokens=rec.prompt_tokens,
            cached_tokens=rec.cached_tokens, completion_tokens=rec.completion_tokens,
            ttft_ms=rec.ttft_ms, total_ms=rec.total_ms, stream=rec.stream))
    return entries


def refusal_json(*, request_id: str, tenant_id: object, key_id: object, model: str, pool: str,
                 http_status: int, error_code: str, end_user: str | None,
                 project_id: object = None, stream: bool = False, prompt_tokens: int = 0,
                 total_ms: float | None = None) -> bytes:
    return json.dumps({
        "request_id": request_id, "tenant_id": tenant_id, "key_id": key_id, "model": model,
        "pool": pool, "http_status": http_status, "error_code": error_code,
        "end_user": end_user, "project_id": project_id, "stream": stream,
        "prompt_tokens": prompt_tokens, "total_ms": total_ms, "at_ms": time.time() * 1000,
    }, separators=(",", ":")).encode()


async def arecord_refusal(client: Any, item: bytes) -> None:
    """Queue one refusal for the log (an asyncio client; one round trip, nothing waits on it)."""
    pipe = client.pipeline(transaction=False)
    pipe.rpush(refusals_pending_key(), item)
    pipe.ltrim(refusals_pending_key(), -settings.REQUEST_LOG_MAX_PENDING, -1)
    await pipe.execute()


def entry_from_refusal(data: Mapping[str, Any]) -> RequestLogEntry:
    end_user, project = context_of(data)
    total = data.get("total_ms")
    return RequestLogEntry(
        request_id=str(data["request_id"])[:64],
        at=datetime.fromtimestamp(float(data["at_ms"]) / 1000, tz=UTC),
        tenant_id=int(data["tenant_id"]), api_key_id=_int_or_none(data.get("key_id")),
        project_id=project, end_user=end_user, model_name=str(data.get("model") or "")[:128],
        pool_name=str(data.get("pool") or "")[:64], http_status=int(data["http_status"]),
        status=REFUSED, error_code=str(data.get("error_code") or "")[:64],
        prompt_tokens=max(0, int(data.get("prompt_tokens") or 0)),
        total_ms=None if total is None else max(0, round(float(total))),
        stream=bool(data.get("stream")))


def _int_or_none(value: Any) -> int | None:
    return None if value in (None, "") else int(value)


def flush_refusals(client: Any, max_batches: int = 100) -> int | None:
    """Write the queued refusals; the number inserted, or None if another writer holds it."""
    queue = refusals_queue()
    token = queue.acquire(client)
    if token is None:
        return None
    inserted = 0
    try:
        for _ in range(max_batches):
            batch = queue.claim(client, token, BATCH_SIZE)
            if not batch:
                break
            entries = []
            for item in batch:
                try:
                    entries.append(entry_from_refusal(json.loads(item)))
                except (ValueError, TypeError, KeyError) as exc:
                    # Dropped, not kept: a refusal is no bill, and the line says what it was.
                    log.error("unreadable request-log refusal (%s): %.200r", exc, item)
            with transaction.atomic():
                inserted += len(RequestLogEntry.objects.bulk_create(entries,
                                                                    ignore_conflicts=True))
            if not queue.release(client, token) or not queue.extend(client, token):
                break
    finally:
        queue.unlock(client, token)
    return inserted


def purge(now: datetime | None = None) -> int:
    """Delete entries older than the retention (one DELETE; the ``at`` index finds them)."""
    cutoff = (now or datetime.now(UTC)) - timedelta(days=settings.REQUEST_LOG_RETENTION_DAYS)
    deleted, _ = RequestLogEntry.objects.filter(at__lt=cutoff).delete()
    return deleted
