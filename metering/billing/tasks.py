"""Celery tasks for finance: report exports and the spend alert check.

Both take ids or nothing, exit if their row is gone, and never retry: an export claims its job
row (``exports.run``) and alerts claim their period (``alerts.fire``), so a duplicate run is a
no-op rather than a second file or a second email.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from gateway.celery import app
from metering.billing import alerts, exports

ALERT_CHECK_EVERY_S = 60.0


@shared_task(name="billing.run_export", ignore_result=True)
def run_export(job_id: int) -> bool:
    return exports.run(job_id)


@shared_task(name="billing.check_spend_alerts", ignore_result=True)
def check_spend_alerts() -> int:
    return len(alerts.check_all())


@shared_task(name="billing.purge_exports", ignore_result=True)
def purge_exports() -> int:
    return exports.purge_old()


@app.on_after_finalize.connect
def _schedule(sender: Any, **_: object) -> None:
    sender.add_periodic_task(ALERT_CHECK_EVERY_S, check_spend_alerts.s(), name="spend alerts")
    sender.add_periodic_task(3600.0, purge_exports.s(), name="purge week-old exports")
