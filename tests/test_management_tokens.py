"""Management tokens end with their maker: account, membership or role, however those end (the
admin, a bulk update, a deleted user), because every authentication checks them. Every token
expires, and the API shows when it expires and when it was last used."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone
from rest_framework.test import APIClient

from tenants import membership
from tenants.management_tokens import issue_token, verify
from tenants.models import ManagementToken, Membership
from tests.worlds import build_world

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(redis_client, settings):
    world = build_world()
    # A second owner, so the first can be demoted or removed.
    Membership.objects.filter(user=world.users["member"], tenant=world.tenant).update(role="owner")
    return world


def _token(world, maker: str = "owner", role: str = "billing") -> str:
    return issue_token(world.tenant, "ci", role, created_by=world.users[maker])[1]


def _status(plaintext: str) -> int:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client.get("/api/tenants/acme/usage/").status_code


def _owner_row(world):
    return Membership.objects.filter(user=world.users["owner"], tenant=world.tenant)


@pytest.mark.parametrize("ending", [
    "membership_deleted", "demoted_to_member", "demoted_to_billing", "account_deactivated",
    "account_deleted",
])
def test_a_token_stops_when_its_maker_stops_being_an_owner(world, ending):
    """Before: removing the membership or deactivating the user left the token working.
    Each change here is a bulk UPDATE/DELETE or a raw user change: no signal, no service."""
    plaintext = _token(world)
    assert _status(plaintext) == 200
    users = get_user_model().objects.filter(pk=world.users["owner"].pk)
    {
        "membership_deleted": lambda: _owner_row(world)._raw_delete(_owner_row(world).db),
        "demoted_to_member": lambda: _owner_row(world).update(role="member"),
        "demoted_to_billing": lambda: _owner_row(world).update(role="billing"),
        "account_deactivated": lambda: users.update(is_active=False),
        "account_deleted": lambda: users.delete(),
    }[ending]()
    assert verify(plaintext) is None
    assert _status(plaintext) == 401


def test_a_token_of_a_deleted_maker_or_without_one_never_works(world):
    token, plaintext = issue_token(world.tenant, "ci", "owner", created_by=None)
    assert verify(plaintext) is None
    assert not ManagementToken.objects.usable().filter(pk=token.pk).exists()


def test_a_role_change_or_deactivation_revokes_the_makers_tokens_for_the_record(world):
    plaintext = _token(world)
    membership.change_role(_owner_row(world).get(), "member")
    assert ManagementToken.objects.get().revoked_at is not None
    _owner_row(world).update(role="owner")
    assert _status(plaintext) == 401  # revoked stays revoked
    _token(world, maker="member")
    maker = world.users["member"]
    maker.is_active = False
    maker.save()  # as the admin's user page does
    assert not ManagementToken.objects.filter(revoked_at__isnull=True).exists()


def test_every_token_expires_by_default_and_never_beyond_the_maximum(world, settings):
    settings.MANAGEMENT_TOKEN_DEFAULT_DAYS = 30
    settings.MANAGEMENT_TOKEN_MAX_DAYS = 60
    token, _ = issue_token(world.tenant, "ci", "owner", created_by=world.users["owner"])
    assert timedelta(days=29, hours=23) < token.expires_at - timezone.now() <= timedelta(days=30)
    token, _ = issue_token(world.tenant, "ci", "owner", created_by=world.users["owner"],
                           expires_at=timezone.now() + timedelta(days=1000))
    assert token.expires_at - timezone.now() <= timedelta(days=60)


def test_the_api_lists_expiry_last_use_and_whether_a_token_works(world):
    plaintext = _token(world)
    _token(world, maker="member")
    assert _status(plaintext) == 200  # sets last_used_at
    client = APIClient()
    client.force_login(world.users["owner"])
    _owner_row(world).update(role="owner")
    rows = client.get("/api/tenants/acme/tokens/").json()["results"]
    assert len(rows) == 2
    used = next(r for r in rows if r["last_used_at"])
    assert used["created_by"] == "owner" and used["expires_at"] and used["active"] is True
    assert "key_hash" not in used
    Membership.objects.filter(user=world.users["member"], tenant=world.tenant).update(
        role="member")
    rows = client.get("/api/tenants/acme/tokens/").json()["results"]
    assert {r["created_by"]: r["active"] for r in rows} == {"owner": True, "member": False}
    assert client.delete(f"/api/tenants/acme/tokens/{used['id']}/").status_code == 204
    assert _status(plaintext) == 401
