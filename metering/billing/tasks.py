"""Celery tasks for finance: report exports, the spend alert check, webhook deliveries.

Exports and the check take ids or nothing, exit if their row is gone, and never retry: an
export claims its job row (``exports.run``) and alerts claim their period (``alerts.fire``), so
a duplicate run is a no-op rather than a second file or a second email.

Webhook deliveries run on their own queue (``webhooks``, see CELERY_TASK_ROUTES), so a slow or
dead receiver never delays exports or the alert check. A failure that may pass (unreachable,
5xx, 429) is retried with exponential backoff and jitter, ``WEBHOOK_MAX_ATTEMPTS`` attempts in
all; receivers deduplicate by the ``X-Gateway-Delivery`` header.
"""

from __future__ import annotations

from celery import shared_task
from celery.app.task import Task
from django.conf import settings

from metering.billing import alerts, budget_alerts, exports
from metering.billing.exports import run_export
from metering.billing.models import AlertEvent

__all__ = ["check_spend_alerts", "purge_exports", "run_export"]


@shared_task(name="billing.check_spend_alerts", ignore_result=True)
def check_spend_alerts() -> int:
    """Spend alerts, then budgets' soft thresholds (50/80/100 %)."""
    return len(alerts.check_all()) + len(budget_alerts.check_all())


@shared_task(name="billing.deliver_webhook", bind=True, ignore_result=True, max_retries=None,
             acks_late=False)
def deliver_webhook(self: Task[[int], str | None], event_id: int) -> str | None:
    outcome = alerts.deliver(event_id)
    if outcome is None or outcome.final:
        return outcome.status if outcome else None
    attempt = self.request.retries + 1
    if attempt >= settings.WEBHOOK_MAX_ATTEMPTS:
        return outcome.status
    AlertEvent.objects.filter(pk=event_id).update(webhook_status=f"{outcome.status}, retrying")
    raise self.retry(countdown=retry_delay(attempt))


def retry_delay(attempt: int) -> float:
    """Exponential backoff with full jitter: base * 2^(attempt-1), capped, times U(0.5, 1)."""
    import random

    ceiling = min(settings.WEBHOOK_RETRY_BASE_SECONDS * 2.0 ** (attempt - 1), 3600.0)
    return ceiling * random.uniform(0.5, 1.0)


@shared_task(name="billing.purge_exports", ignore_result=True)
def purge_exports() -> int:
    return exports.purge_old()
