"""Break-glass access: the only way content is ever decrypted.

1. ``request_access``: a staff user with ``contentlog.request_breakglass`` asks for one
   tenant's records in one time window, with a written justification and a duration.
2. ``approve`` / ``deny``: a *different* staff user with ``contentlog.approve_breakglass``
   decides. Self-approval is refused unless ``BREAKGLASS_SELF_APPROVAL`` is on, and then it
   alerts the platform admins. Approval starts the clock: access ends at approval + duration.
3. ``read_records``: only the requester, only while the grant is approved and unexpired, only
   that tenant's records in that window. Each decrypted record gets an audit entry written in
   the same transaction *before* any plaintext is returned, and the tenant's owners are mailed.

Every step writes an append-only ``AuditEntry``; tenants read theirs with
``audit_entries_for_tenant``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.mail import mail_admins, send_mail
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from gateway.contentlog.models import AuditEntry, BreakGlassGrant, ContentRecord
from gateway.contentlog.store import decrypt_record
from tenants.models import Membership, Tenant

log = logging.getLogger(__name__)

MIN_JUSTIFICATION = 20
REQUEST_PERM = "contentlog.request_breakglass"
APPROVE_PERM = "contentlog.approve_breakglass"


class BreakGlassDenied(PermissionError):
    """The user, the grant or the moment does not allow this."""


@dataclass(frozen=True)
class DecryptedRecord:
    record_id: str
    request_id: str
    created_at: datetime
    prompt: Any
    response: Any


def _staff_with(user: User, perm: str) -> None:
    if not (user.is_active and getattr(user, "is_staff", False) and user.has_perm(perm)):
        raise BreakGlassDenied(f"needs an active staff account with {perm}")


def _audit(grant: BreakGlassGrant, action: str, user: User, **extra: Any) -> None:
    AuditEntry.objects.create(
        tenant_id=grant.tenant_id, grant_id=grant.pk, action=action, actor_id=user.pk,
        actor_username=user.get_username(), justification=grant.justification, **extra,
    )


def request_access(user: User, tenant: Tenant, justification: str,
                   records_from: datetime, records_until: datetime,
                   duration: timedelta) -> BreakGlassGrant:
    _staff_with(user, REQUEST_PERM)
    justification = justification.strip()
    if len(justification) < MIN_JUSTIFICATION:
        raise ValueError(f"justification must be at least {MIN_JUSTIFICATION} characters")
    if records_until <= records_from:
        raise ValueError("the records window is empty")
    max_minutes = settings.BREAKGLASS_MAX_MINUTES
    minutes = int(duration.total_seconds() // 60)
    if not 1 <= minutes <= max_minutes:
        raise ValueError(f"access may last 1 to {max_minutes} minutes")
    with transaction.atomic():
        grant = BreakGlassGrant.objects.create(
            tenant=tenant, requested_by=user, justification=justification,
            records_from=records_from, records_until=records_until, duration_minutes=minutes,
        )
        _audit(grant, AuditEntry.Action.REQUESTED, user)
    return grant


def approve(grant: BreakGlassGrant, approver: User) -> BreakGlassGrant:
    _staff_with(approver, APPROVE_PERM)
    self_approval = approver.pk == grant.requested_by_id
    if self_approval and not settings.BREAKGLASS_SELF_APPROVAL:
        raise BreakGlassDenied("a second staff member must approve")
    now = timezone.now()
    with transaction.atomic():
        # Conditional UPDATE: two approvers clicking at once decide once.
        decided = BreakGlassGrant.objects.filter(
            pk=grant.pk, state=BreakGlassGrant.State.PENDING
        ).update(
            state=BreakGlassGrant.State.APPROVED, approved_by=approver, decided_at=now,
            self_approved=self_approval,
            access_until=now + timedelta(minutes=grant.duration_minutes),
        )
        if not decided:
            raise BreakGlassDenied("the grant is not pending")
        grant.refresh_from_db()
        action = AuditEntry.Action.SELF_APPROVED if self_approval else AuditEntry.Action.APPROVED
        _audit(grant, action, approver)
    if self_approval:
        _alert_self_approval(grant)
    _notify_owners(grant, f"Break-glass access to your content log was approved ({action}).")
    return grant


def deny(grant: BreakGlassGrant, user: User) -> None:
    _decide_closed(grant, user, BreakGlassGrant.State.DENIED, AuditEntry.Action.DENIED,
                   from_states=[BreakGlassGrant.State.PENDING])


def revoke(grant: BreakGlassGrant, user: User) -> None:
    """End an approved grant early (its requester or any approver)."""
    _decide_closed(grant, user, BreakGlassGrant.State.REVOKED, AuditEntry.Action.REVOKED,
                   from_states=[BreakGlassGrant.State.APPROVED, BreakGlassGrant.State.PENDING])


def _decide_closed(grant: BreakGlassGrant, user: User, state: str, action: str,
                   from_states: list[str]) -> None:
    if user.pk != grant.requested_by_id:
        _staff_with(user, APPROVE_PERM)
    with transaction.atomic():
        changed = BreakGlassGrant.objects.filter(pk=grant.pk, state__in=from_states).update(
            state=state, decided_at=timezone.now()
        )
        if not changed:
            raise BreakGlassDenied(f"the grant cannot become {state}")
        grant.refresh_from_db()
        _audit(grant, action, user)


def is_open(grant: BreakGlassGrant, now: datetime | None = None) -> bool:
    now = now or timezone.now()
    return (grant.state == BreakGlassGrant.State.APPROVED and grant.access_until is not None
            and now < grant.access_until)


def records_in_scope(grant: BreakGlassGrant) -> QuerySet[ContentRecord]:
    """Metadata of the records a grant covers (no decryption, no audit needed)."""
    return ContentRecord.objects.for_tenant(grant.tenant_id).filter(
        created_at__gte=grant.records_from, created_at__lt=grant.records_until
    ).order_by("created_at").defer("ciphertext")


def read_records(grant: BreakGlassGrant, user: User, *,
                 record_ids: list[str] | None = None, limit: int = 50,
                 now: datetime | None = None) -> list[DecryptedRecord]:
    """Decrypt records under a grant; every record is audited before its plaintext is returned."""
    grant.refresh_from_db()
    _staff_with(user, REQUEST_PERM)
    if user.pk != grant.requested_by_id:
        raise BreakGlassDenied("only the requester may read under a grant")
    if not is_open(grant, now):
        raise BreakGlassDenied("the grant is not approved or has expired")
    rows = records_in_scope(grant).defer(None)
    if record_ids is not None:
        rows = rows.filter(pk__in=record_ids)
    out: list[DecryptedRecord] = []
    with transaction.atomic():
        for row in list(rows[:limit]):
            # The audit row is written first: if it cannot be written, nothing is decrypted.
            _audit(grant, AuditEntry.Action.DECRYPTED, user, record_id=row.pk,
                   request_id=row.request_id)
            body = decrypt_record(row)
            out.append(DecryptedRecord(str(row.pk), row.request_id, row.created_at,
                                       body.get("prompt"), body.get("response")))
    if out:
        _notify_owners(grant, f"{len(out)} record(s) of your content log were decrypted "
                              f"by {user.get_username()} under break-glass grant {grant.pk}.")
    return out


def audit_entries_for_tenant(tenant: Tenant | int) -> QuerySet[AuditEntry]:
    """The portal's view: audit entries about this tenant's data, newest first."""
    return AuditEntry.objects.filter(
        tenant_id=tenant.pk if isinstance(tenant, Tenant) else tenant)


def grants_for_tenant(tenant: Tenant | int) -> QuerySet[BreakGlassGrant]:
    return BreakGlassGrant.objects.filter(tenant_id=getattr(tenant, "pk", tenant))


def _owner_emails(tenant_id: int) -> list[str]:
    return sorted({
        email for email in Membership.objects.filter(
            tenant_id=tenant_id, role=Membership.Role.OWNER, user__is_active=True
        ).values_list("user__email", flat=True) if email
    })


def _notify_owners(grant: BreakGlassGrant, headline: str) -> None:
    recipients = _owner_emails(grant.tenant_id)
    if not recipients:
        log.warning("break-glass grant %s: tenant %s has no owner email to notify",
                    grant.pk, grant.tenant_id)
        return
    body = (f"{headline}\n\nRequested by: {grant.requested_by.get_username()}\n"
            f"Justification: {grant.justification}\n"
            f"Records created between {grant.records_from:%Y-%m-%d %H:%M} and "
            f"{grant.records_until:%Y-%m-%d %H:%M} UTC.\n"
            f"Access ends: {grant.access_until:%Y-%m-%d %H:%M} UTC.\n"
            "Every decryption is listed in your portal's audit log.")
    try:
        send_mail("[inference gateway] break-glass access to your content log", body,
                  None, recipients)
    except Exception as exc:  # the audit entry is the record of truth; mail is best effort
        log.error("break-glass notification for grant %s failed: %s", grant.pk, exc)


def _alert_self_approval(grant: BreakGlassGrant) -> None:
    log.warning("break-glass grant %s on tenant %s was SELF-APPROVED by %s",
                grant.pk, grant.tenant_id, grant.requested_by.get_username())
    try:
        mail_admins(f"Self-approved break-glass grant {grant.pk}",
                    f"Tenant {grant.tenant_id}. Justification: {grant.justification}")
    except Exception as exc:
        log.error("self-approval alert for grant %s failed: %s", grant.pk, exc)
