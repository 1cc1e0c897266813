"""Onboarding from the admin (a tenant and its first owner's invitation in one step; an account
made without a password gets a set-password link) and invitations that explain themselves
(expired page, Resend, no second pending invitation to one address)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from tenants.models import Invitation, Membership, Tenant
from tests.worlds import build_world

pytestmark = pytest.mark.django_db
INVITE = re.compile(r"https?://\S+/portal/invitation/[\w-]+/")
RESET = re.compile(r"https?://testserver(/portal/password-reset/\S+/)")


@pytest.fixture
def world(redis_client, settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    return build_world()


def client_of(world, who: str) -> Client:
    client = Client()
    client.force_login(world.users[who])
    return client


def test_create_a_tenant_and_invite_its_first_owner_in_one_step(world):
    admin = client_of(world, "admin")
    assert "first_owner_email" in admin.get(reverse("admin:tenants_tenant_add")).content.decode()
    mail.outbox.clear()
    answer = admin.post(reverse("admin:tenants_tenant_add"), {
        "name": "Newco", "slug": "newco", "status": "active", "region": "local",
        "tier": world.tenant.tier_id,
        "first_owner_email": "boss@newco.test",
        **{f"{prefix}-{k}": v for prefix in ("quotas", "api_keys")
           for k, v in (("TOTAL_FORMS", "0"), ("INITIAL_FORMS", "0"))}}, follow=True)
    assert answer.redirect_chain, re.findall(r"errorlist[^<]*<li>([^<]*)", answer.content.decode())
    tenant = Tenant.objects.get(slug="newco")
    [message] = mail.outbox
    assert message.to == ["boss@newco.test"] and "as owner" in message.body
    link = INVITE.search(message.body).group(0).split("testserver", 1)[1]
    invitation = Invitation.objects.get(tenant=tenant)
    assert invitation.role == "owner"
    joined = Client().post(link, {"username": "boss", "password1": "Boss-pass-12345",
                                  "password2": "Boss-pass-12345"})
    assert joined.status_code == 302
    assert Membership.objects.get(tenant=tenant).role == "owner"
    # The change page has no such field: invitations after the first are the owners' job.
    change = admin.get(reverse("admin:tenants_tenant_change", args=[tenant.pk])).content.decode()
    assert "first_owner_email" not in change


def test_tenant_add_for_staff_without_permissions(world):
    staff = client_of(world, "staff")
    assert staff.get(reverse("admin:tenants_tenant_add")).status_code == 403
    for who in ("owner", "member", "billing", "outsider"):  # not staff: the admin's sign-in
        assert client_of(world, who).get(reverse("admin:tenants_tenant_add")).status_code == 302


def test_an_account_made_without_a_password_gets_a_set_password_link(world):
    admin = client_of(world, "admin")
    mail.outbox.clear()
    answer = admin.post(reverse("admin:auth_user_add"), {
        "username": "newbie", "usable_password": "false", "password1": "", "password2": ""})
    assert answer.status_code == 302, answer.content.decode()[:3000]
    user = get_user_model().objects.get(username="newbie")
    assert not user.has_usable_password() and not mail.outbox  # no email yet: told so
    user.email = "newbie@example.test"
    user.save()
    admin.post(reverse("admin:auth_user_changelist"), {
        "action": "send_set_password_links", "_selected_action": [user.pk]})
    [message] = mail.outbox
    path = RESET.search(message.body).group(1)
    browser = Client()
    form = browser.get(path, follow=True)
    done = browser.post(form.redirect_chain[-1][0], {"new_password1": "Newbie-pass-123",
                                                     "new_password2": "Newbie-pass-123"})
    assert done.status_code == 302
    signed_in = Client().post("/portal/login/", {"username": "newbie",
                                                 "password": "Newbie-pass-123"})
    assert signed_in.status_code == 302


def test_expired_invitation_says_so_and_can_be_resent(world):
    owner = client_of(world, "owner")
    mail.outbox.clear()
    owner.post(reverse("portal:members"), {"email": "late@example.test", "role": "member"})
    link = INVITE.search(mail.outbox[0].body).group(0).split("testserver", 1)[1]
    old = Invitation.objects.get()
    Invitation.objects.filter(pk=old.pk).update(expires_at=timezone.now() - timedelta(hours=1))
    page = Client().get(link)
    assert page.status_code == 404 and "has expired" in page.content.decode()
    members = owner.get(reverse("portal:members")).content.decode()
    row = members[members.index('data-email="late@example.test"'):]
    assert "expired" in row[:row.index("</tr>")] and "Resend" in row[:row.index("</tr>")]
    mail.outbox.clear()
    assert owner.post(reverse("portal:invitation_resend", args=[old.pk])).status_code == 302
    [message] = mail.outbox
    assert message.to == ["late@example.test"]
    new_link = INVITE.search(message.body).group(0).split("testserver", 1)[1]
    assert Client().get(new_link).status_code == 200
    assert Invitation.objects.filter(email="late@example.test").pending().count() == 1


def test_one_address_is_not_invited_twice(world):
    owner = client_of(world, "owner")
    owner.post(reverse("portal:members"), {"email": "twice@example.test", "role": "member"})
    again = owner.post(reverse("portal:members"), {"email": "TWICE@example.test",
                                                   "role": "owner"})
    assert again.status_code == 200 and "already has a pending invitation" in \
        again.content.decode()
    assert Invitation.objects.filter(email__iexact="twice@example.test").count() == 1


def test_resend_for_every_seat(world):
    client_of(world, "owner").post(reverse("portal:members"),
                                   {"email": "seat@example.test", "role": "member"})
    invitation = Invitation.objects.get()
    url = reverse("portal:invitation_resend", args=[invitation.pk])
    for who in ("member", "billing"):
        assert client_of(world, who).post(url).status_code == 403, who
    assert client_of(world, "outsider").post(url).status_code == 404  # another tenant's
    assert client_of(world, "staff").post(url).status_code == 302  # no tenant: no_tenant
    assert Invitation.objects.get().revoked_at is None
    assert client_of(world, "owner").post(url).status_code == 302
    assert Invitation.objects.pending().count() == 1
