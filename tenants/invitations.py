"""Invitations: how a person joins a tenant, by a single-use, expiring link sent to their email.

An owner names an address and a role; nothing about existing accounts is looked up or revealed,
so the answer is the same whether or not the address belongs to anyone. Whoever opens the link
accepts it: by creating an account (whose email is the invited address, proven by receiving the
mail) or as the user already signed in (password or SSO). Only a SHA-256 of the link's secret is
stored.

Invariant: an invitation is accepted at most once. One conditional UPDATE (still pending:
not accepted, not revoked, not expired) decides, so two tabs accepting at once add one
membership.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.mail import send_mail
from django.db import transaction
from django.utils import timezone

from infra.email_limits import allow_email
from tenants.models import Invitation, InvitationQuerySet, Membership, Tenant

log = logging.getLogger(__name__)
MAX_PENDING = 100  # per tenant: an owner cannot turn the platform into a mail cannon
_RANK = {Membership.Role.MEMBER: 0, Membership.Role.BILLING: 1, Membership.Role.OWNER: 2}


class InvitationInvalid(Exception):
    """Unknown, used, revoked or expired: the same answer for each."""


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def invite(tenant: Tenant, email: str, role: str, invited_by: Any,
           link_for: Callable[[str], str]) -> Invitation:
    """Record the invitation and email its link (``link_for(secret)``, an absolute URL)."""
    if Invitation.objects.filter(tenant=tenant).pending().count() >= MAX_PENDING:
        raise ValidationError({"email": f"This tenant has {MAX_PENDING} pending invitations; "
                                        "revoke some first."})
    if Invitation.objects.filter(tenant=tenant, email__iexact=email.strip()).pending().exists():
        raise ValidationError({"email": "This address already has a pending invitation; "
                                        "resend or revoke it instead."})
    if not allow_email("invite", email, f"user:{getattr(invited_by, 'pk', '')}"):
        raise ValidationError({"email": "Too many invitation emails for this address or from "
                                        "you in the last hour. Try again later."})
    secret = secrets.token_urlsafe(32)
    with transaction.atomic():  # no invitation on record that its invitee never got
        invitation = Invitation.objects.create(
            tenant=tenant, email=email.strip(), role=role, invited_by=invited_by,
            secret_hash=_hash(secret),
            expires_at=timezone.now() + timedelta(days=settings.INVITATION_DAYS),
        )
        try:
            _send(invitation, invited_by, link_for(secret))
        except OSError as exc:  # SMTP errors included
            log.warning("invitation email to tenant %s failed: %s", tenant.slug, exc)
            raise ValidationError({"email": "The invitation email could not be sent. "
                                            "Try again later."}) from None
    return invitation


def _send(invitation: Invitation, invited_by: Any, link: str) -> None:
    tenant = invitation.tenant
    inviter = getattr(invited_by, "email", "") or getattr(invited_by, "username", "An owner")
    send_mail(
        subject=f"You are invited to {tenant.name}",
        message=(
            f"{inviter} invited you to join {tenant.name} as {invitation.role} on the "
            f"inference gateway.\n\nAccept: {link}\n\n"
            f"The link works once and expires on {invitation.expires_at:%Y-%m-%d %H:%M} UTC. "
            "If you did not expect this, ignore this email.\n"
        ),
        from_email=None, recipient_list=[invitation.email],
    )


def find(secret: str) -> Invitation | None:
    """The invitation behind a link, whatever its state (None if there is none)."""
    return Invitation.objects.select_related("tenant").filter(secret_hash=_hash(secret)).first()


def pending(secret: str) -> Invitation | None:
    return Invitation.objects.pending().select_related("tenant").filter(
        secret_hash=_hash(secret)).first()


def accept(secret: str, user: Any) -> Membership:
    """Use the link for ``user``: their membership in the tenant, with the invited role (never
    lowering a role they already have there)."""
    return _claim(Invitation.objects.filter(secret_hash=_hash(secret)), user)


def accept_pending_for_identity(tenant_id: int, email: str, user: Any) -> list[Membership]:
    """A tenant's own identity provider vouched for ``email`` at ``user``'s first sign-in: the
    tenant's pending invitations to that address are accepted. Only that tenant's: another
    tenant's provider proves nothing about this tenant's invitations."""
    accepted = []
    for invitation in Invitation.objects.pending().filter(tenant_id=tenant_id,
                                                          email__iexact=email):
        try:
            accepted.append(_claim(Invitation.objects.filter(pk=invitation.pk), user))
        except InvitationInvalid:
            continue  # taken or revoked meanwhile
    return accepted


def _claim(invitation: InvitationQuerySet, user: Any) -> Membership:
    with transaction.atomic():
        claimed = invitation.pending().update(accepted_at=timezone.now(), accepted_by=user)
        if claimed != 1:
            raise InvitationInvalid
        found = invitation.get()
        membership, made = Membership.objects.get_or_create(
            user=user, tenant_id=found.tenant_id, defaults={"role": found.role})
        upgrade = _RANK[Membership.Role(found.role)] > _RANK[Membership.Role(membership.role)]
        if not made and upgrade:
            membership.role = found.role
            membership.save(update_fields=["role"])
    return membership


def free_username(wanted: str) -> str:
    """``wanted``, or ``wanted`` with a random suffix when it is taken: an invitation's form
    answers the same whether a name exists (review 3). The suffix is random, so the names that
    exist cannot be counted through it; the portal's welcome names the account's username.
    """
    users = get_user_model().objects
    name = wanted
    while users.filter(username__iexact=name).exists():
        name = f"{wanted[:140]}-{secrets.token_hex(3)}"
    return name


def accept_with_new_account(secret: str, username: str, password: str) -> Membership:
    """Create the invitee's account (with the invited email) and accept, all or nothing."""
    with transaction.atomic():
        invitation = pending(secret)
        if invitation is None:
            raise InvitationInvalid
        user = get_user_model().objects.create_user(free_username(username),
                                                    email=invitation.email, password=password)
        return accept(secret, user)


def revoke(invitation: Invitation) -> None:
    Invitation.objects.filter(pk=invitation.pk, accepted_at__isnull=True,
                              revoked_at__isnull=True).update(revoked_at=timezone.now())
