"""Joining a tenant by invitation: one emailed, single-use, expiring link; the same answer
whether or not the address has an account; accepting creates the account or attaches the
signed-in one. Also password reset, in the portal's layout."""

from __future__ import annotations

import re
import threading

import pytest
from django.contrib.auth import get_user_model
from django.core import mail
from django.core.exceptions import ValidationError
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from tenants import invitations
from tenants.models import Invitation, Membership
from tests.worlds import PASSWORD, build_world, make_user

pytestmark = pytest.mark.django_db
LINK = re.compile(r"https?://\S+/portal/invitation/[\w-]+/")


@pytest.fixture
def world(redis_client, settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    return build_world()


def _owner(world) -> Client:
    client = Client()
    client.force_login(world.users["owner"])
    return client


def _invite(world, email: str, role: str = "member") -> str:
    mail.outbox.clear()
    _owner(world).post(reverse("portal:members"), {"email": email, "role": role})
    [message] = mail.outbox
    assert message.to == [email]
    return LINK.search(message.body).group(0)


def _path(link: str) -> str:
    return link.split("testserver", 1)[1]


def test_the_answer_is_the_same_whether_or_not_the_address_has_an_account(world):
    """Before: adding by username or email revealed the email, and an unknown user got a
    different error, so accounts could be enumerated."""
    answers = []
    for email in ("member@example.test", "nobody@example.test"):
        response = _owner(world).post(reverse("portal:members"),
                                      {"email": email, "role": "billing"}, follow=True)
        page = response.content.decode().replace(email, "EMAIL")
        answers.append((response.status_code, response.redirect_chain,
                        re.search(r'<ul class="messages">.*?</ul>', page, re.S).group(0)))
    assert answers[0] == answers[1]
    # One pending invitation per address: withdraw those before asking the API the same.
    Invitation.objects.update(revoked_at=timezone.now())
    api = APIClient()
    api.force_login(world.users["owner"])
    bodies = []
    for email in ("member@example.test", "nobody@example.test"):
        response = api.post("/api/tenants/acme/invitations/", {"email": email}, format="json")
        body = response.json()
        bodies.append((response.status_code, sorted(body), body["role"]))
        assert "user" not in body and "username" not in body
    assert bodies[0] == bodies[1]
    # Nobody was added: an invitation is an offer, accepted by the invitee.
    assert not Membership.objects.filter(tenant=world.tenant, user__email="nobody@example.test")


def test_a_new_person_creates_an_account_from_the_link_once(world):
    link = _invite(world, "newcomer@example.test", role="billing")
    visitor = Client()
    form = visitor.get(_path(link))
    assert form.status_code == 200 and "newcomer@example.test" in form.content.decode()
    joined = visitor.post(_path(link), {"username": "newcomer", "password1": PASSWORD,
                                        "password2": PASSWORD}, follow=True)
    assert joined.redirect_chain[-1][0] == reverse("portal:usage")
    user = get_user_model().objects.get(username="newcomer")
    assert user.email == "newcomer@example.test" and user.check_password(PASSWORD)
    assert Membership.objects.get(user=user).role == "billing"
    again = Client().post(_path(link), {"username": "second", "password1": PASSWORD,
                                        "password2": PASSWORD})
    assert again.status_code == 404 and "not valid" in again.content.decode()
    assert not get_user_model().objects.filter(username="second").exists()


def test_the_new_account_form_does_not_reveal_which_usernames_exist(world):
    """Review 3: the link's form answered "already exists" for a taken username. Now a taken
    name and a free one get the same answer; the taken one is made unique, and the welcome
    names the account's username."""
    taken = world.users["member"].get_username()
    answers = []
    for name in (taken, "free-name"):
        link = _invite(world, f"{name}-inv@example.test")
        visitor = Client()
        joined = visitor.post(_path(link), {"username": name, "password1": PASSWORD,
                                            "password2": PASSWORD}, follow=True)
        answers.append((joined.status_code, joined.redirect_chain))
        assert b"already exists" not in joined.content
        user = get_user_model().objects.get(email=f"{name}-inv@example.test")
        assert f"Your username is {user.get_username()}" in joined.content.decode()
    assert answers[0] == answers[1]
    made = get_user_model().objects.get(email=f"{taken}-inv@example.test")
    assert made.username.startswith(f"{taken}-") and made != world.users["member"]
    assert world.users["member"].email != made.email  # the existing account is untouched


def test_a_signed_in_user_joins_with_one_click_and_never_loses_a_role(world):
    link = _invite(world, "whatever@example.test", role="member")
    outsider = Client()
    outsider.force_login(world.users["outsider"])
    assert "Join Acme" in outsider.get(_path(link)).content.decode()
    assert not Membership.objects.filter(user=world.users["outsider"], tenant=world.tenant)
    outsider.post(_path(link))
    assert Membership.objects.get(user=world.users["outsider"], tenant=world.tenant).role == \
        "member"
    link = _invite(world, "owner@example.test", role="member")
    owner = _owner(world)
    owner.post(_path(link))
    assert Membership.objects.get(user=world.users["owner"], tenant=world.tenant).role == "owner"


def test_signing_in_from_the_link_accepts_it(world):
    link = _invite(world, "outsider@example.test", role="billing")
    visitor = Client()
    page = visitor.get(_path(link)).content.decode()
    login_url = re.search(r'href="(/portal/login/\?next=[^"]+)"', page).group(1)
    response = visitor.post(login_url.replace("&amp;", "&"), {
        "username": "outsider", "password": PASSWORD, "next": _path(link)}, follow=True)
    assert response.redirect_chain[-1][0] == reverse("portal:usage")
    assert Membership.objects.get(user=world.users["outsider"], tenant=world.tenant).role == \
        "billing"
    assert Invitation.objects.get().accepted_by == world.users["outsider"]


@pytest.mark.parametrize("state", ["expired", "revoked"])
def test_expired_or_revoked_links_do_nothing(world, state):
    link = _invite(world, "late@example.test")
    invitation = Invitation.objects.get()
    if state == "expired":
        Invitation.objects.filter(pk=invitation.pk).update(expires_at=timezone.now())
    else:
        _owner(world).post(reverse("portal:invitation_revoke", args=[invitation.pk]))
    response = Client().post(_path(link), {"username": "late", "password1": PASSWORD,
                                           "password2": PASSWORD})
    assert response.status_code == 404
    assert not get_user_model().objects.filter(username="late").exists()


def test_the_members_page_lists_pending_invitations_and_only_owners_invite(world):
    _invite(world, "pending@example.test")
    page = _owner(world).get(reverse("portal:members")).content.decode()
    assert "pending@example.test" in page and 'id="invite"' in page
    member = Client()
    member.force_login(world.users["member"])
    assert member.post(reverse("portal:members"), {"email": "x@example.test",
                                                   "role": "owner"}).status_code == 403
    assert Invitation.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_acceptances_at_once_add_one_membership(redis_client, settings):
    """The invariant: one conditional UPDATE decides who uses the link."""
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    world = build_world()
    secrets: list[str] = []
    invitations.invite(world.tenant, "race@example.test", "member", world.users["owner"],
                       secrets.append)
    [secret] = secrets
    barrier, outcomes = threading.Barrier(4), []

    def accept(user) -> None:
        barrier.wait()
        try:
            invitations.accept(secret, user)
            outcomes.append("ok")
        except invitations.InvitationInvalid:
            outcomes.append("refused")
        finally:
            connection.close()

    users = [*(world.users[u] for u in ("outsider", "staff", "admin")), make_user("fourth")]
    threads = [threading.Thread(target=accept, args=(u,)) for u in users]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["ok", "refused", "refused", "refused"]
    joined = Membership.objects.filter(tenant=world.tenant, user__in=users)
    assert joined.count() == 1


def test_password_reset_by_email_in_the_portal_layout(world):
    mail.outbox.clear()
    client = Client()
    form = client.get(reverse("portal:password_reset"))
    assert form.status_code == 200 and "portal.css" in form.content.decode()
    sent = client.post(reverse("portal:password_reset"), {"email": "member@example.test"})
    unknown = client.post(reverse("portal:password_reset"), {"email": "none@example.test"})
    assert sent.status_code == unknown.status_code == 302
    assert sent["Location"] == unknown["Location"]  # the same answer either way
    [message] = mail.outbox
    link = re.search(r"http://testserver(/portal/password-reset/\S+/)", message.body).group(1)
    page = client.get(link, follow=True)
    assert "Choose a new password" in page.content.decode()
    done = client.post(page.redirect_chain[-1][0], {"new_password1": "An0ther long secret!",
                                                     "new_password2": "An0ther long secret!"})
    assert done.status_code == 302
    response = Client().post(reverse("portal:login"), {"username": "member",
                                                       "password": "An0ther long secret!"})
    assert response.status_code == 302


def test_a_mail_server_failure_leaves_no_invitation_and_says_so(world, settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = "127.0.0.1", 9, 2
    response = _owner(world).post(reverse("portal:members"),
                                  {"email": "x@example.test", "role": "member"})
    assert response.status_code == 200 and "could not be sent" in response.content.decode()
    assert not Invitation.objects.exists()


def test_password_reset_emails_are_limited_per_address_and_per_client(world):
    """Review 3: the reset form mailed an address as often as asked. Over the limit the answer
    is the same "sent" redirect, and no email goes out."""
    from infra.email_limits import PER_ADDRESS, PER_REQUESTER
    mail.outbox.clear()
    client = Client()
    answers = {client.post(reverse("portal:password_reset"),
                           {"email": "member@example.test"})["Location"]
               for _ in range(PER_ADDRESS + 3)}
    assert len(answers) == 1 and len(mail.outbox) == PER_ADDRESS
    # One client asking for many addresses is stopped too (all unknown: nothing is mailed,
    # but each counts), and then a known address gets nothing from it either.
    for i in range(PER_REQUESTER):
        client.post(reverse("portal:password_reset"), {"email": f"n{i}@example.test"})
    mail.outbox.clear()
    world.users["owner"].email = "owner-reset@example.test"
    world.users["owner"].save()
    client.post(reverse("portal:password_reset"), {"email": "owner-reset@example.test"})
    assert mail.outbox == []
    # Another client still reaches an address under its own limit.
    Client(REMOTE_ADDR="10.9.9.9").post(reverse("portal:password_reset"),
                                        {"email": "owner-reset@example.test"})
    assert len(mail.outbox) == 1


def test_invitation_emails_are_limited_per_address(world):
    from infra.email_limits import PER_ADDRESS
    owner = world.users["owner"]
    for _ in range(PER_ADDRESS):
        invitation = invitations.invite(world.tenant, "again@example.test", "member", owner,
                                        lambda s: f"http://x/{s}/")
        invitations.revoke(invitation)  # revoke and re-invite: the loop the review used
    with pytest.raises(ValidationError, match="Too many invitation emails"):
        invitations.invite(world.tenant, "again@example.test", "member", owner,
                           lambda s: f"http://x/{s}/")
