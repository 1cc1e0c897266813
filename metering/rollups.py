"""Hourly rollups per tenant, key, model and end user, recomputed from that hour's records.

Recomputing an hour (rather than adding increments) makes the job idempotent: running it twice,
or after a crash half-way, gives the same rows. The writer marks each hour it inserted records
for in ``usage:dirty_hours``; the rollup recomputes those hours and unmarks an hour only after
its rows are committed, so a late record (a writer backlog) still lands in its hour's row.
One rollup runs at a time (a Redis lease), so two recomputations never interleave their upserts.
An hour's rows are replaced in one transaction (delete, then insert): a group that no longer
exists (rows written before end users were part of the key) leaves no stale row to count twice.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Count, Q, Sum
from django.db.models.functions import Coalesce

from infra.leased_queue import Lease
from infra.redis_conn import get_redis, key, text
from metering.keys import dirty_hours_key
from metering.models import UsageRecord, UsageRollup

LEASE_MS = 120_000
_CLEAR = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


def rollup_hour(hour: datetime) -> int:
    """Recompute every (tenant, key, model, end user) row for one hour; returns the number of
    rows."""
    groups = (
        UsageRecord.objects.filter(finished_at__gte=hour, finished_at__lt=hour + timedelta(hours=1))
        .values("tenant_id", "api_key_id", "model_name", "end_user")
        .annotate(
            n=Count("id"),
            n_err=Count("id", filter=~Q(status=UsageRecord.Status.OK)),
            prompt=Sum("prompt_tokens"),
            cached=Sum("cached_tokens"),
            completion=Sum("completion_tokens"),
            ttft=Coalesce(Sum("ttft_ms"), 0),
            total=Coalesce(Sum("total_ms"), 0),
        )
        .order_by()
    )
    rows = [
        UsageRollup(
            hour=hour, tenant_id=g["tenant_id"], api_key_id=g["api_key_id"],
            model_name=g["model_name"], end_user=g["end_user"], requests=g["n"],
            errors=g["n_err"],
            prompt_tokens=g["prompt"], cached_tokens=g["cached"],
            completion_tokens=g["completion"], ttft_ms_sum=g["ttft"], total_ms_sum=g["total"],
        )
        for g in groups
    ]
    with transaction.atomic():
        # Readers see the old rows or the new ones, never neither (one transaction).
        UsageRollup.objects.filter(hour=hour).delete()
        UsageRollup.objects.bulk_create(rows)
    return len(rows)


def rollup_dirty(limit: int = 48) -> list[datetime] | None:
    """Recompute the hours the writer marked. None if another rollup holds the lease."""
    client, lease = get_redis(), Lease(key("usage", "rollup_lease"), LEASE_MS)
    token = lease.acquire(client)
    if token is None:
        return None
    done: list[datetime] = []
    try:
        marks = client.hgetall(dirty_hours_key())
        for raw, version in sorted(marks.items())[:limit]:
            hour = datetime.fromisoformat(text(raw))
            rollup_hour(hour)
            client.register_script(_CLEAR)(keys=[dirty_hours_key()], args=[raw, version])
            done.append(hour)
    finally:
        lease.unlock(client, token)
    return sorted(done)
