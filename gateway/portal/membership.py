"""Membership changes shared by the portal and the API: a tenant always keeps an owner."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q

from gateway.portal.roles import OWNER
from tenants.models import Membership, Tenant

LAST_OWNER = "A tenant must keep at least one owner."


def _check_other_owner(membership: Membership) -> None:
    # Lock the tenant's owner rows so two owners demoting each other at once cannot both pass.
    owners = Membership.objects.select_for_update().filter(tenant_id=membership.tenant_id,
                                                           role=OWNER)
    if not any(o.pk != membership.pk for o in owners):
        raise ValidationError({"role": LAST_OWNER})


def change_role(membership: Membership, role: str) -> None:
    with transaction.atomic():
        if membership.role == OWNER and role != OWNER:
            _check_other_owner(membership)
        membership.role = role
        membership.save(update_fields=["role"])


def remove(membership: Membership) -> None:
    with transaction.atomic():
        if membership.role == OWNER:
            _check_other_owner(membership)
        membership.delete()


def add(tenant: Tenant, username_or_email: str, role: str) -> Membership:
    user = get_user_model().objects.filter(
        Q(username=username_or_email) | Q(email__iexact=username_or_email)
    ).first()
    if user is None:
        raise ValidationError({"user": "No user with that username or email."})
    if Membership.objects.filter(user=user, tenant=tenant).exists():
        raise ValidationError({"user": "Already a member."})
    return Membership.objects.create(user=user, tenant=tenant, role=role)
