"""Drain ``usage:pending`` into ``UsageRecord`` in batches, losing and duplicating nothing.

Settlement pushes one JSON record per request onto its pool's ``usage:{p.POOL}:pending``
(``serving.settlement``; one queue per pool so the push shares the settling script's slot, ADR
0018). The writer drains every pool's queue in turn, each under that pool's own lease.
The writer moves a batch to ``usage:processing`` and inserts it; the batch leaves Redis only
after the transaction that holds it has committed. Invariants:

- A record is always in ``usage:pending``, in ``usage:processing``, or in the database. A
  writer that crashes after claiming leaves its batch in ``usage:processing``; the next writer
  inserts that first.
- Inserting is idempotent (``request_id`` is unique, conflicts are skipped), so re-inserting a
  batch after a crash between commit and delete writes nothing twice.
- Only the holder of the writer lease claims or deletes, and each claim/delete checks the lease
  token inside its Lua script, so a writer whose lease lapsed (a long GC pause, a slow commit)
  can never delete a batch a newer writer claimed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.db import transaction

from infra.leased_queue import LeasedQueue
from infra.redis_conn import get_redis
from metering import fairness, metrics, requestlog
from metering.keys import (
    dead_key,
    dirty_hours_key,
    lease_key,
    pending_key,
    pool_names,
    processing_key,
)
from metering.models import RequestLogEntry, UsageRecord

log = logging.getLogger(__name__)

BATCH_SIZE = 500
LEASE_MS = 60_000


@dataclass
class FlushResult:
    claimed: int = 0
    inserted: int = 0
    rejected: int = 0
    hours: set[datetime] = field(default_factory=set)


def _queue(pool: str) -> LeasedQueue:
    return LeasedQueue(pending_key(pool), processing_key(pool), lease_key(pool), LEASE_MS)


def flush(batch_size: int = BATCH_SIZE, max_batches: int = 100) -> FlushResult | None:
    """Write every pool's pending usage records. None if other writers hold every pool's lease
    right now (and there is a pool)."""
    client = get_redis()
    result, held = FlushResult(), 0
    pools = pool_names(client)
    for pool in pools:
        held += not _flush_pool(client, _queue(pool), batch_size, max_batches, result)
    # Refused requests have no usage record: their request-log entries have their own queue.
    requestlog.flush_refusals(client)
    return None if pools and held == len(pools) else result


def _flush_pool(client: Any, queue: LeasedQueue, batch_size: int, max_batches: int,
                result: FlushResult) -> bool:
    """One pool's queue; False if another writer holds its lease."""
    token = queue.acquire(client)
    if token is None:
        return False
    try:
        # A claim hands back what a crashed writer left first, then new records.
        for _ in range(max_batches):
            batch = queue.claim(client, token, batch_size)
            if not batch or not _write_batch(client, queue, token, batch, result):
                break
            if not queue.extend(client, token):
                log.warning("usage writer lost its lease; stopping, the next writer goes on")
                break
    finally:
        queue.unlock(client, token)
    return True


def _write_batch(client: Any, queue: LeasedQueue, token: str, raw: list[bytes],
                 result: FlushResult) -> bool:
    pairs, bad = parse_pairs(raw)
    records = [record for record, _ in pairs]
    with transaction.atomic():
        created = UsageRecord.objects.bulk_create(records, ignore_conflicts=True)
        # The tenants' request log, in the same transaction: an entry exactly when a record.
        RequestLogEntry.objects.bulk_create(requestlog.entries_from_usage(pairs),
                                            ignore_conflicts=True)
    result.claimed += len(raw)
    result.inserted += len(created)
    result.rejected += len(bad)
    hours = {hour_of(r.finished_at) for r in records}
    result.hours |= hours
    # Not a transaction: under Redis Cluster these keys live on several nodes. A crash part way
    # loses no more than a crash between the commit above and this pipeline always could.
    pipe = client.pipeline(transaction=False)
    if bad:
        # Kept, not dropped: a record we cannot parse is a bug to look at, and still a bill.
        pipe.rpush(dead_key(), *bad)
    for hour in hours:
        # A version per hour, not a set member: see metering.rollups for why.
        pipe.hincrby(dirty_hours_key(), hour.isoformat(), 1)
    metrics.add_records(pipe, records)
    fairness.add_records(pipe, pairs)
    pipe.execute()
    released = queue.release(client, token)
    if not released:
        log.warning("usage writer lost its lease; the next writer re-inserts the batch")
    return bool(released)


def parse_batch(raw: Iterable[bytes]) -> tuple[list[UsageRecord], list[bytes]]:
    pairs, bad = parse_pairs(raw)
    return [record for record, _ in pairs], bad


def parse_pairs(raw: Iterable[bytes]
                ) -> tuple[list[tuple[UsageRecord, dict[str, Any]]], list[bytes]]:
    """Each readable record with the JSON it came from (the request log reads more of it)."""
    records: dict[str, tuple[UsageRecord, dict[str, Any]]] = {}
    bad: list[bytes] = []
    for item in raw:
        try:
            data = json.loads(item)
            record = record_from_json(data)
        except (ValueError, TypeError, KeyError) as exc:
            log.error("unreadable usage record (%s): %.200r", exc, item)
            bad.append(item)
            continue
        records[record.request_id] = (record, data)  # a duplicate inside one batch counts once
    return list(records.values()), bad


def record_from_json(data: Mapping[str, Any]) -> UsageRecord:
    """One settlement record -> an unsaved UsageRecord (fields as settle.lua writes them)."""
    finished = _time_ms(data, "settled_at") or _time(_first(data, "finished_at", default=None))
    started = _time_ms(data, "admitted_at") or _time(_first(data, "started_at", default=None))
    if finished is None:
        raise ValueError("no finish time")
    started = started or finished
    return UsageRecord(
        request_id=str(_first(data, "request_id", "rid"))[:64],
        tenant_id=int(data["tenant_id"]),
        api_key_id=_int_or_none(_first(data, "key_id", "api_key_id", default=None)),
        model_name=str(_first(data, "model", "model_name"))[:128],
        pool_name=str(_first(data, "pool", "pool_name", default=""))[:64],
        prompt_tokens=_count(_first(data, "prompt_tokens", default=0)),
        cached_tokens=_count(_first(data, "cached_tokens", "cached_prompt_tokens", default=0)),
        completion_tokens=_count(_first(data, "completion_tokens", "output_tokens", default=0)),
        queue_wait_ms=_ms(data, "queue_wait"),
        ttft_ms=_ms(data, "ttft"),
        total_ms=_ms(data, "total", "latency"),
        status=str(_first(data, "status", default="ok"))[:16],
        finish_reason=str(_first(data, "finish_reason", default=""))[:32],
        error_code=str(_first(data, "error_code", default=""))[:64],
        stream=bool(data.get("stream", False)),
        end_user=str(data.get("end_user") or "")[:256],
        started_at=started,
        finished_at=finished,
    )


_MISSING = object()


def _first(data: Mapping[str, Any], *names: str, default: Any = _MISSING) -> Any:
    for name in names:
        if data.get(name) is not None:
            return data[name]
    if default is _MISSING:
        raise KeyError(names[0])
    return default


def _count(value: Any) -> int:
    number = int(value)
    if number < 0:
        raise ValueError("negative count")
    return number


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _ms(data: Mapping[str, Any], *stems: str) -> int | None:
    for stem in stems:
        if data.get(f"{stem}_ms") is not None:
            return max(0, round(float(data[f"{stem}_ms"])))
        if data.get(f"{stem}_s") is not None:
            return max(0, round(float(data[f"{stem}_s"]) * 1000))
    return None


def _time_ms(data: Mapping[str, Any], stem: str) -> datetime | None:
    value = data.get(f"{stem}_ms")
    return None if value is None else datetime.fromtimestamp(float(value) / 1000, tz=UTC)


def _time(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) or (isinstance(value, str) and _is_number(value)):
        return datetime.fromtimestamp(float(value), tz=UTC)
    parsed = datetime.fromisoformat(str(value))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def hour_of(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
