"""Celery tasks for finance: report exports and the spend alert check.

Both take ids or nothing, exit if their row is gone, and never retry: an export claims its job
row (``exports.run``) and alerts claim their period (``alerts.fire``), so a duplicate run is a
no-op rather than a second file or a second email.
"""

from __future__ import annotations

from celery import shared_task

from metering.billing import alerts, exports
from metering.billing.exports import run_export

__all__ = ["check_spend_alerts", "purge_exports", "run_export"]


@shared_task(name="billing.check_spend_alerts", ignore_result=True)
def check_spend_alerts() -> int:
    return len(alerts.check_all())


@shared_task(name="billing.purge_exports", ignore_result=True)
def purge_exports() -> int:
    return exports.purge_old()
