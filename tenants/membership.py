"""Membership changes shared by the portal and the API.

Invariant: a tenant always keeps an owner. Demoting or removing an owner locks the tenant's
owner rows first, so two owners demoting each other at once cannot both pass.
When someone stops being an owner, the management tokens they made stop too (checked on every
use by ``ManagementToken.objects.usable``, and revoked for the record by ``tenants.signals``).
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import transaction

from tenants.models import ApiKey, Membership
from tenants.roles import OWNER

# The playground's keys are named so (gateway.portal.playground); a removed member's ends with
# the membership (review 3). Their ordinary keys are the tenant's and keep working until an
# owner revokes them: applications in production use them (docs/security.md).
PLAYGROUND_PREFIX = "playground ·"

LAST_OWNER = "A tenant must keep at least one owner."


def is_last_owner(membership: Membership) -> bool:
    return membership.role == OWNER and not Membership.objects.filter(
        tenant_id=membership.tenant_id, role=OWNER).exclude(pk=membership.pk).exists()


def _check_other_owner(membership: Membership) -> None:
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


def remove(membership: Membership, revoke_keys: bool = False) -> int:
    """Remove a member and, in the same transaction, revoke their playground key (and every
    key they created here, with ``revoke_keys``); returns how many keys they created here are
    still usable (they keep working)."""
    with transaction.atomic():
        if membership.role == OWNER:
            _check_other_owner(membership)
        theirs = ApiKey.objects.filter(tenant_id=membership.tenant_id,
                                       created_by_id=membership.user_id)
        (theirs if revoke_keys else theirs.filter(name__startswith=PLAYGROUND_PREFIX)).revoke()
        membership.delete()
        return theirs.usable().count()
