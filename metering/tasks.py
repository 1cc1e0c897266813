"""Celery tasks: flush pending usage records, then roll up the hours they touched.

Both are short, idempotent and safe to run concurrently (each takes a Redis lease and returns at
once if another run holds it), so they are scheduled every few seconds and never retried: the
next run picks up whatever this one did not finish.
"""

from __future__ import annotations

from celery import shared_task

from metering import requestlog, rollups, writer


@shared_task(name="metering.flush_usage", ignore_result=True)
def flush_usage() -> int:
    result = writer.flush()
    return result.inserted if result else 0


@shared_task(name="metering.rollup_usage", ignore_result=True)
def rollup_usage() -> int:
    # Flush first so the rollup sees everything settled so far.
    writer.flush()
    return len(rollups.rollup_dirty() or [])


@shared_task(name="metering.purge_request_log", ignore_result=True)
def purge_request_log() -> int:
    return requestlog.purge()
