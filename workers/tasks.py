"""Short Celery tasks of the serving layer. Generations are never Celery tasks (ADR 0002).

Each task is short and idempotent, acked before it runs and never retried: the next scheduled
run picks up whatever this one did not finish. (Usage flushing lives in ``metering.tasks``.)
"""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from serving import janitor
from workers import cell_quota


@shared_task(name="workers.janitor_sweep", ignore_result=True)
def janitor_sweep() -> dict[str, list[str]]:
    """Reap dead workers and settle overdue requests (also runs inside every pool worker)."""
    return janitor.sweep().as_dict()


@shared_task(name="cells.rebalance_quotas", ignore_result=True)
def rebalance_quotas() -> int:
    """Move split tenants' quota shares between cells by recent demand (serving.cells)."""
    if not settings.CELLS:
        return 0
    return len(cell_quota.rebalance_all())
