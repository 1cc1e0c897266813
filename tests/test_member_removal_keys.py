"""Review 3: a removed member's playground key ends with the membership, in the same
transaction; their ordinary keys are the tenant's and keep working until an owner revokes
them, which the owner is told."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from gateway.portal.playground import playground_key
from tenants import membership
from tenants.api_keys import issue_key
from tenants.models import ApiKey, Membership
from tests.factories import make_tenant

pytestmark = pytest.mark.django_db


def test_removing_a_member_ends_their_playground_key_and_keeps_their_ordinary_keys() -> None:
    tenant = make_tenant()
    user = get_user_model().objects.create_user("leaver", password="x-long-password-1")
    member = Membership.objects.create(tenant=tenant, user=user, role=Membership.Role.MEMBER)
    play = playground_key({}, tenant, user).key
    ordinary, _ = issue_key(tenant, "their app", created_by=user)
    assert membership.remove(member) == 1  # one ordinary key still works, and the owner is told
    assert not ApiKey.objects.get(pk=play.pk).is_usable()  # at once, not in 30 minutes
    assert ApiKey.objects.get(pk=ordinary.pk).is_usable()


def test_the_owner_is_told_which_keys_keep_working(client) -> None:
    tenant = make_tenant()
    users = get_user_model().objects
    owner = users.create_user("owner1", password="x-long-password-1")
    leaver = users.create_user("leaver2", password="x-long-password-1")
    Membership.objects.create(tenant=tenant, user=owner, role=Membership.Role.OWNER)
    target = Membership.objects.create(tenant=tenant, user=leaver, role=Membership.Role.MEMBER)
    issue_key(tenant, "their app", created_by=leaver)
    client.force_login(owner)
    session = client.session
    session["portal_tenant_id"] = tenant.pk
    session.save()
    r = client.post(f"/portal/members/{target.pk}/", {"role": "remove"}, follow=True)
    assert r.status_code == 200
    assert b"1 API key(s) leaver2 created still work" in r.content


def test_the_owner_can_remove_a_member_and_revoke_their_keys_at_once(client) -> None:
    tenant = make_tenant()
    users = get_user_model().objects
    owner = users.create_user("owner3", password="x-long-password-1")
    leaver = users.create_user("leaver3", password="x-long-password-1")
    Membership.objects.create(tenant=tenant, user=owner, role=Membership.Role.OWNER)
    target = Membership.objects.create(tenant=tenant, user=leaver, role=Membership.Role.MEMBER)
    key, _ = issue_key(tenant, "their app", created_by=leaver)
    mine, _ = issue_key(tenant, "owner's app", created_by=owner)
    client.force_login(owner)
    session = client.session
    session["portal_tenant_id"] = tenant.pk
    session.save()
    assert b"remove_revoke" in client.get("/portal/members/").content
    r = client.post(f"/portal/members/{target.pk}/", {"role": "remove_revoke"}, follow=True)
    assert r.status_code == 200 and not Membership.objects.filter(pk=target.pk).exists()
    assert not ApiKey.objects.get(pk=key.pk).is_usable()
    assert ApiKey.objects.get(pk=mine.pk).is_usable()  # only theirs
