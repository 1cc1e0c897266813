"""Spend alerts: measure a tenant's (or key's) tokens or money this period, notify once.

Once per period: an alert whose threshold is crossed claims the period with one conditional
UPDATE (``last_fired_period`` != this period -> this period). Only the caller whose UPDATE
changed the row notifies, so checkers running in several processes at once, or every minute
for the rest of the month, email the owners exactly once; the next period fires anew.
Usage comes from the hourly rollups, so an alert lags usage by the rollup interval (~30 s).

Webhooks are not called here: firing queues a delivery on the ``webhooks`` Celery queue
(``tasks.deliver_webhook``), where short timeouts and retries with backoff cannot hold up the
back-office tasks, and every attempt re-checks the address (``metering.billing.webhooks``).
A tenant has at most ``SPEND_ALERTS_MAX_PER_TENANT`` alerts (``create_alert``).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from celery import current_app
from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.db.models import F, Sum
from django.utils import timezone

from metering.billing import reports, webhooks
from metering.billing.models import AlertEvent, SpendAlert
from tenants.auth import invalidate_principals
from tenants.models import ApiKey, Membership, Tenant

log = logging.getLogger(__name__)
QUEUED = "queued"


class TooManyAlerts(Exception):
    """The tenant already has ``SPEND_ALERTS_MAX_PER_TENANT`` alerts."""

    def __init__(self) -> None:
        cap = settings.SPEND_ALERTS_MAX_PER_TENANT
        super().__init__(f"A tenant may have at most {cap} spend alerts; remove one first.")


def create_alert(tenant: Tenant, **fields: Any) -> SpendAlert:
    """Create an alert under the per-tenant cap.

    Invariant: a tenant never has more than SPEND_ALERTS_MAX_PER_TENANT alerts. Count and insert
    happen in one transaction holding the tenant row's lock, so two creations racing for the
    last slot are serialised and the second sees the first's row.
    """
    with transaction.atomic():
        Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
        if SpendAlert.objects.filter(tenant=tenant).count() >= (
                settings.SPEND_ALERTS_MAX_PER_TENANT):
            raise TooManyAlerts()
        return SpendAlert.objects.create(tenant=tenant, **fields)


def period_of(alert: SpendAlert, now: datetime) -> tuple[str, datetime]:
    """The period's label and start (UTC) for ``now``."""
    day = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if alert.period == SpendAlert.Period.DAY:
        return day.strftime("%Y-%m-%d"), day
    return day.strftime("%Y-%m"), day.replace(day=1)


def measure(alert: SpendAlert, start: datetime, end: datetime) -> Decimal:
    key_ids = [alert.api_key_id] if alert.api_key_id else None
    if alert.metric == SpendAlert.Metric.TOKENS:
        sums = reports.rollups(start, end, tenant=alert.tenant, api_key_ids=key_ids).aggregate(
            prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens")
        )
        return Decimal((sums["prompt"] or 0) + (sums["completion"] or 0))
    report = reports.build_report(
        start, end, tenant=alert.tenant, group_by=(), api_key_ids=key_ids
    )
    # Amounts in two currencies are never added: only usage priced in the alert's currency.
    return sum((t.amount or Decimal(0) for t in report.totals if t.currency == alert.currency),
               Decimal(0))


def check_all(now: datetime | None = None) -> list[AlertEvent]:
    now = now or timezone.now()
    fired = []
    for alert in SpendAlert.objects.filter(enabled=True).select_related("tenant", "api_key"):
        if event := check(alert, now):
            fired.append(event)
    return fired


def check(alert: SpendAlert, now: datetime) -> AlertEvent | None:
    period, start = period_of(alert, now)
    if alert.last_fired_period == period:
        return None  # cheap skip; the UPDATE below is what guarantees once
    value = measure(alert, start, now + timedelta(hours=1))
    if value < alert.threshold:
        return None
    claimed = (
        SpendAlert.objects.filter(pk=alert.pk).exclude(last_fired_period=period)
        .update(last_fired_period=period)
    )
    return fire(alert, period, value) if claimed else None


def fire(alert: SpendAlert, period: str, value: Decimal) -> AlertEvent:
    suspended = _suspend(alert) if alert.hard_cap else False
    event = AlertEvent.objects.create(
        alert=alert, period=period, value=value, suspended=suspended,
        emailed=_email_owners(alert, period, value, suspended),
    )
    if alert.webhook_url:
        event.webhook_status = QUEUED
        event.save(update_fields=["webhook_status"])
        transaction.on_commit(lambda: _queue_delivery(event.pk))
    return event


def _queue_delivery(event_id: int) -> None:
    try:
        # By name: the task module imports this one (metering.billing.tasks).
        current_app.tasks["billing.deliver_webhook"].delay(event_id)
    except Exception as exc:  # a broker outage must not lose the email or the suspension
        log.error("spend alert event %s: webhook not queued: %s", event_id, type(exc).__name__)
        AlertEvent.objects.filter(pk=event_id).update(webhook_status="not sent")


def describe(alert: SpendAlert, period: str, value: Decimal, suspended: bool) -> str:
    scope = f"key {alert.api_key.name} ({alert.api_key.masked})" if alert.api_key else "tenant"
    text = (
        f"{alert.tenant.name}: {scope} used {alert.value_text(value)} in {period}, "
        f"over the alert threshold of {alert.threshold_text}."
    )
    if suspended:
        text += (" The hard cap is on: the key is over budget and its requests are refused "
                 "(429 insufficient_quota) until an owner raises the cap or resumes it."
                 if alert.api_key else " The hard cap is on: the tenant was suspended.")
    return text


NOTIFIED_ROLES = (Membership.Role.OWNER, Membership.Role.BILLING)


def notify_emails(tenant: Tenant) -> list[str]:
    """Who hears about spend: the tenant's owners and its billing members."""
    return list(
        Membership.objects.filter(tenant=tenant, role__in=NOTIFIED_ROLES)
        .exclude(user__email="").values_list("user__email", flat=True).distinct()
    )


def _email_owners(alert: SpendAlert, period: str, value: Decimal, suspended: bool) -> int:
    emails = notify_emails(alert.tenant)
    if not emails:
        return 0
    subject = f"[gateway] Spend alert for {alert.tenant.name} ({period})"
    body = describe(alert, period, value, suspended)
    body += (f"\n\nSee the usage and the alert in the portal: {settings.PUBLIC_BASE_URL}"
             "/portal/usage/ (alerts: /portal/alerts/).")
    sent = send_mail(subject, body, settings.DEFAULT_FROM_EMAIL, emails, fail_silently=True)
    return len(emails) if sent else 0


def webhook_body(event: AlertEvent) -> bytes:
    """The same bytes on every attempt, so a receiver can deduplicate by the delivery id."""
    alert = event.alert
    return json.dumps({
        "type": "spend_alert", "delivery": f"alert-event-{event.pk}", "tenant": alert.tenant.slug,
        "alert_id": alert.pk, "api_key": alert.api_key.prefix if alert.api_key else None,
        "metric": alert.metric, "period": event.period, "value": f"{event.value.normalize():f}",
        "threshold": str(alert.threshold),
        "currency": alert.currency if alert.is_money else None, "suspended": event.suspended,
        "message": describe(alert, event.period, event.value, event.suspended),
    }).encode()


def deliver(event_id: int) -> webhooks.Outcome | None:
    """One delivery attempt of an event's webhook; records the outcome. None: nothing to do."""
    event = (AlertEvent.objects.select_related("alert__tenant", "alert__api_key")
             .filter(pk=event_id).first())
    if event is None or not event.alert.webhook_url:
        return None
    alert = event.alert
    if not alert.webhook_secret:  # made before deliveries were signed
        alert.save()
    outcome = webhooks.post(alert.webhook_url, webhook_body(event), secret=alert.webhook_secret,
                            delivery_id=f"alert-event-{event.pk}")
    AlertEvent.objects.filter(pk=event.pk).update(
        webhook_status=outcome.status, webhook_attempts=F("webhook_attempts") + 1)
    if not outcome.delivered:
        log.warning("spend alert %s webhook: %s", alert.pk, outcome.status)
    return outcome


def _suspend(alert: SpendAlert) -> bool:
    """Hard cap: the key is marked over budget (it still authenticates, and answers 429
    insufficient_quota until an owner resumes it: never rewritten to look expired), or the
    whole tenant is suspended."""
    if alert.api_key_id:
        changed = ApiKey.objects.filter(pk=alert.api_key_id, over_budget_at__isnull=True) \
            .usable().update(over_budget_at=timezone.now())
        invalidate_principals()
        return bool(changed)
    tenant = Tenant.objects.get(pk=alert.tenant_id)
    if tenant.is_active:
        tenant.set_status(Tenant.Status.SUSPENDED)
        return True
    return False
