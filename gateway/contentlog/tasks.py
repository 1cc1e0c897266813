"""Celery tasks: drain the content-log queue, purge expired records.

Short and idempotent; the drain takes a Redis lease, the purge deletes by primary key in
batches, so overlapping runs are harmless and a failed run is simply retried by the next one.
"""

from __future__ import annotations

from celery import shared_task

from gateway.contentlog import lifecycle, store


@shared_task(name="contentlog.drain", ignore_result=True)
def drain_content() -> int:
    total = 0
    for _ in range(10):  # bounded: one run never monopolises a worker
        result = store.drain()
        if result is None or not result.claimed:
            break
        total += result.written
    return total


@shared_task(name="contentlog.purge_expired", ignore_result=True)
def purge_expired() -> int:
    return lifecycle.purge_expired()
