"""Sign-in throttling (django-axes) on the portal's and the admin's login forms: after
SIGNIN_FAILURE_LIMIT failed passwords for one username from one address, the next attempt is
refused, even with the right password; another address or username is unaffected, and a
forged X-Forwarded-For changes nothing."""

from __future__ import annotations

import pytest
from django.contrib.auth.tokens import default_token_generator
from django.test import Client
from django.utils.encoding import force_bytes
from django.utils.http import urlsafe_base64_encode

from tests.worlds import PASSWORD, make_user

pytestmark = pytest.mark.django_db
LIMIT = 3
FORMS = {"portal": "/portal/login/", "admin": "/admin/login/"}


@pytest.fixture
def users(settings):
    settings.AXES_FAILURE_LIMIT = LIMIT
    return make_user("owner", is_staff=True), make_user("bystander", is_staff=True)


def _try(url: str, username: str, password: str, addr: str = "10.0.0.1", **headers: str):
    return Client(REMOTE_ADDR=addr, **headers).post(
        url, {"username": username, "password": password})


@pytest.mark.parametrize("form", FORMS)
def test_the_attempt_after_the_limit_is_refused_even_with_the_right_password(users, form):
    url = FORMS[form]
    assert _try(url, "owner", PASSWORD).status_code == 302  # signs in while under the limit
    for _ in range(LIMIT - 1):
        assert _try(url, "owner", "wrong").status_code == 200  # the form, with its error
    locked = _try(url, "owner", "wrong")  # the limit-th failure locks the pair
    assert locked.status_code == 429
    refused = _try(url, "owner", PASSWORD)  # ... and the next attempt is refused
    assert refused.status_code == 429 and "_auth_user_id" not in refused.client.session
    assert "Too many failed sign-in attempts" in refused.content.decode()
    # A forged forwarded address is not another address.
    assert _try(url, "owner", PASSWORD, HTTP_X_FORWARDED_FOR="10.9.9.9").status_code == 429
    # Another address, or another account, still signs in.
    assert _try(url, "owner", PASSWORD, addr="10.0.0.2").status_code == 302
    assert _try(url, "bystander", PASSWORD).status_code == 302


def test_the_lockout_page_says_how_long_to_wait(users, settings):
    settings.AXES_COOLOFF_TIME = 0.25  # hours: 15 minutes
    for _ in range(LIMIT):
        locked = _try("/portal/login/", "owner", "wrong")
    page = locked.content.decode()
    assert locked.status_code == 429 and "Try again in <strong>15 minutes</strong>" in page
    assert 14 * 60 <= int(locked["Retry-After"]) <= 15 * 60
    assert 'href="/portal/password-reset/"' in page


def test_a_password_reset_lifts_the_lockout_for_that_account(users):
    owner, _ = users
    for _ in range(LIMIT):
        _try("/portal/login/", "owner", "wrong")
    assert _try("/portal/login/", "owner", PASSWORD).status_code == 429
    browser = Client(REMOTE_ADDR="10.0.0.1")
    uid = urlsafe_base64_encode(force_bytes(owner.pk))
    token = default_token_generator.make_token(owner)
    form = browser.get(f"/portal/password-reset/{uid}/{token}/", follow=True)
    done = browser.post(form.redirect_chain[-1][0], {"new_password1": "A-new-long-pass-42",
                                                     "new_password2": "A-new-long-pass-42"})
    assert done.status_code == 302, done.content.decode()[:500]
    assert _try("/portal/login/", "owner", "A-new-long-pass-42").status_code == 302
