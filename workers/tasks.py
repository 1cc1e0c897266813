"""Short Celery tasks of the serving layer. Generations are never Celery tasks (ADR 0002).

Each task is short and idempotent, acked before it runs and never retried: the next scheduled
run picks up whatever this one did not finish. (Usage flushing lives in ``metering.tasks``.)
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from gateway.celery import app

JANITOR_EVERY_S = 5.0


@shared_task(name="workers.janitor_sweep", ignore_result=True)
def janitor_sweep() -> dict[str, list[str]]:
    """Reap dead workers and settle overdue requests (also runs inside every pool worker)."""
    from workers import janitor

    return janitor.sweep().as_dict()


def janitor_every_s() -> float:
    """Often enough that a dead worker's streams end within WORKER_DEAD_AFTER_SECONDS and a
    half; never more often than WORKER_HEARTBEAT_SECONDS."""
    from django.conf import settings

    return max(settings.WORKER_HEARTBEAT_SECONDS,
               min(JANITOR_EVERY_S, settings.WORKER_DEAD_AFTER_SECONDS / 2))


@app.on_after_finalize.connect
def _schedule(sender: Any, **_: object) -> None:
    # A backstop under `celery beat`: pool workers already sweep, but a pool whose workers all
    # died has nobody left to sweep it (`manage.py serve` runs a housekeeping worker for this).
    # A sweep nobody picked up in time is dropped: the next one does the same work.
    every = janitor_every_s()
    sender.add_periodic_task(every, janitor_sweep.s().set(expires=every),
                             name="janitor sweep")
