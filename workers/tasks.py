"""Short Celery tasks of the serving layer. Generations are never Celery tasks (ADR 0002).

Each task is short and idempotent, acked before it runs and never retried: the next scheduled
run picks up whatever this one did not finish. (Usage flushing lives in ``metering.tasks``.)
"""

from __future__ import annotations

from celery import shared_task

from serving import janitor


@shared_task(name="workers.janitor_sweep", ignore_result=True)
def janitor_sweep() -> dict[str, list[str]]:
    """Reap dead workers and settle overdue requests (also runs inside every pool worker)."""
    return janitor.sweep().as_dict()
