"""Spend alerts: measure a tenant's (or key's) tokens or money this period, notify once.

Once per period: an alert whose threshold is crossed claims the period with one conditional
UPDATE (``last_fired_period`` != this period -> this period). Only the caller whose UPDATE
changed the row notifies, so checkers running in several processes at once, or every minute
for the rest of the month, email the owners exactly once; the next period fires anew.
Usage comes from the hourly rollups, so an alert lags usage by the rollup interval (~30 s).
"""

from __future__ import annotations

import json
import logging
import urllib.request
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.core.mail import send_mail
from django.db.models import Sum
from django.utils import timezone

from metering.billing import reports
from metering.billing.models import AlertEvent, SpendAlert
from tenants.auth import invalidate_principals
from tenants.models import ApiKey, Membership, Tenant

log = logging.getLogger(__name__)
WEBHOOK_TIMEOUT_S = 5.0


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
        event.webhook_status = _post_webhook(alert, period, value, suspended)
        event.save(update_fields=["webhook_status"])
    return event


def describe(alert: SpendAlert, period: str, value: Decimal, suspended: bool) -> str:
    scope = f"key {alert.api_key.name} ({alert.api_key.masked})" if alert.api_key else "tenant"
    text = (
        f"{alert.tenant.name}: {scope} used {alert.value_text(value)} in {period}, "
        f"over the alert threshold of {alert.threshold_text}."
    )
    if suspended:
        text += " The hard cap is on: the key was suspended." if alert.api_key else (
            " The hard cap is on: the tenant was suspended."
        )
    return text


def _email_owners(alert: SpendAlert, period: str, value: Decimal, suspended: bool) -> int:
    emails = list(
        Membership.objects.filter(tenant=alert.tenant, role=Membership.Role.OWNER)
        .exclude(user__email="").values_list("user__email", flat=True)
    )
    if not emails:
        return 0
    subject = f"[gateway] Spend alert for {alert.tenant.name} ({period})"
    body = describe(alert, period, value, suspended)
    sent = send_mail(subject, body, settings.DEFAULT_FROM_EMAIL, emails, fail_silently=True)
    return len(emails) if sent else 0


def _post_webhook(alert: SpendAlert, period: str, value: Decimal, suspended: bool) -> str:
    body = json.dumps({
        "type": "spend_alert", "tenant": alert.tenant.slug, "alert_id": alert.pk,
        "api_key": alert.api_key.prefix if alert.api_key else None, "metric": alert.metric,
        "period": period, "value": str(value), "threshold": str(alert.threshold),
        "currency": alert.currency if alert.is_money else None,
        "suspended": suspended, "message": describe(alert, period, value, suspended),
    }).encode()
    request = urllib.request.Request(
        alert.webhook_url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=WEBHOOK_TIMEOUT_S) as response:
            return f"HTTP {response.status}"
    except Exception as exc:  # a dead webhook must not stop the email or the next alert
        log.warning("spend alert %s webhook failed: %s", alert.pk, exc)
        return f"failed: {exc}"[:64]


def _suspend(alert: SpendAlert) -> bool:
    """Hard cap: the key stops authenticating now (expired), or the whole tenant is suspended."""
    if alert.api_key_id:

        changed = ApiKey.objects.filter(pk=alert.api_key_id).usable().update(
            expires_at=timezone.now()
        )
        invalidate_principals()
        return bool(changed)
    tenant = Tenant.objects.get(pk=alert.tenant_id)
    if tenant.is_active:
        tenant.set_status(Tenant.Status.SUSPENDED)
        return True
    return False
