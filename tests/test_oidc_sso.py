"""Portal SSO: mapping provider identities to memberships, and the full code flow locally."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from django.contrib.auth import get_user_model

from gateway import sso
from tenants import oidc
from tenants.models import IdentityProvider, Membership
from tests.factories import make_tenant

ISSUER = "https://login.acme.example/"


@pytest.fixture
def provider(db):
    return IdentityProvider.objects.create(
        tenant=make_tenant("acme"), name="Acme", issuer=ISSUER, audience="api",
        jwks_url="https://login.acme.example/jwks", sso_enabled=True, sso_client_id="portal",
        claim_mapping={"subject": "sub", "email": "email", "sso_role_claim": "groups",
                       "sso_roles": {"gw-owners": "owner", "gw-billing": "billing"}},
    )


def test_a_new_identity_becomes_a_member_of_the_providers_tenant_only(provider):
    user = sso.map_sso_user(provider, {"sub": "u-1", "email": "dev@acme.example"})
    assert user.email == "dev@acme.example" and not user.has_usable_password()
    assert not user.is_staff
    assert list(Membership.objects.filter(user=user).values_list("tenant_id", "role")) == [
        (provider.tenant_id, "member")]
    assert sso.map_sso_user(provider, {"sub": "u-1"}).pk == user.pk  # same subject, same user


def test_roles_follow_the_role_claim(provider):
    user = sso.map_sso_user(provider, {"sub": "u-2", "groups": ["staff", "gw-billing"]})
    assert Membership.objects.get(user=user).role == "billing"
    sso.map_sso_user(provider, {"sub": "u-2", "groups": ["gw-owners", "gw-billing"]})
    assert Membership.objects.get(user=user).role == "owner"
    sso.map_sso_user(provider, {"sub": "u-2", "groups": []})
    assert Membership.objects.get(user=user).role == "member"


def test_an_email_claim_never_takes_over_an_existing_account(provider):
    victim = get_user_model().objects.create_user("victim", "owner@other.example", "pw-123456")
    other = make_tenant("other")
    Membership.objects.create(user=victim, tenant=other, role="owner")
    user = sso.map_sso_user(provider, {"sub": "attacker", "email": "owner@other.example"})
    assert user.pk != victim.pk
    assert not Membership.objects.filter(user=user, tenant=other).exists()


def test_the_same_subject_at_two_providers_is_two_users(provider):
    second = IdentityProvider.objects.create(
        tenant=make_tenant("beta"), name="Beta", issuer="https://login.beta.example/",
        audience="api", jwks_url="https://login.beta.example/jwks", sso_enabled=True)
    a = sso.map_sso_user(provider, {"sub": "same"})
    b = sso.map_sso_user(second, {"sub": "same"})
    assert a.pk != b.pk


def test_a_first_sign_in_takes_up_its_tenants_invitations_only(provider):
    """An invitation to the address the tenant's own provider asserts is accepted at the first
    SSO sign-in, with its role; another tenant's invitation to the same address is not."""
    from datetime import timedelta

    from django.utils import timezone

    from tenants.models import Invitation

    later = timezone.now() + timedelta(days=1)
    other = make_tenant("other")
    mine = Invitation.objects.create(tenant=provider.tenant, email="Dev@Acme.example",
                                     role="billing", secret_hash="a" * 64, expires_at=later)
    theirs = Invitation.objects.create(tenant=other, email="dev@acme.example", role="owner",
                                       secret_hash="b" * 64, expires_at=later)
    user = sso.map_sso_user(provider, {"sub": "u-9", "email": "dev@acme.example"})
    assert list(Membership.objects.filter(user=user).values_list("tenant_id", "role")) == [
        (provider.tenant_id, "billing")]
    mine.refresh_from_db()
    theirs.refresh_from_db()
    assert mine.accepted_by == user and theirs.accepted_at is None


def test_no_subject_no_user(provider):
    with pytest.raises(oidc.TokenRejected):
        sso.map_sso_user(provider, {"email": "x@acme.example"})


class FakeProvider:
    """Token and JWKS endpoints on 127.0.0.1; the test sets the ID token to hand out."""

    def __init__(self, key) -> None:
        self.key, self.id_token, self.token_requests = key, "", []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, data: dict) -> None:
                body = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                algo = jwt.get_algorithm_by_name("ES256")
                jwk = json.loads(algo.to_jwk(outer.key.public_key())) | {"kid": "s1"}
                self._send({"keys": [jwk]})

            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                outer.token_requests.append(parse_qs(self.rfile.read(length).decode()))
                self._send({"id_token": outer.id_token, "access_token": "at",
                            "token_type": "Bearer"})

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True).start()


@pytest.fixture
def live_provider(db, settings):
    settings.LOGIN_REDIRECT_URL = "/after-login/"
    fake = FakeProvider(ec.generate_private_key(ec.SECP256R1()))
    registration = IdentityProvider.objects.create(
        tenant=make_tenant("live"), name="Live", issuer=ISSUER, audience="api",
        jwks_url=f"{fake.base}/jwks", algorithms=["ES256"], sso_enabled=True,
        sso_client_id="portal-client", sso_client_secret="s3cret",
        sso_authorization_endpoint="https://login.acme.example/authorize",
        sso_token_endpoint=f"{fake.base}/token",
    )
    oidc.jwks_cache.clear()
    yield fake, registration
    fake.httpd.shutdown()
    fake.httpd.server_close()


def _id_token(fake, **overrides) -> str:
    now = int(time.time())
    claims = {"iss": ISSUER, "aud": "portal-client", "sub": "emp-7", "email": "emp@acme.example",
              "iat": now, "exp": now + 300} | overrides
    return jwt.encode(claims, fake.key, algorithm="ES256", headers={"kid": "s1"})


def _start(client, registration) -> dict:
    response = client.get(f"/sso/{registration.pk}/login/")
    assert response.status_code == 302
    redirect = urlparse(response["Location"])
    assert redirect.netloc == "login.acme.example"
    return {k: v[0] for k, v in parse_qs(redirect.query).items()}


def test_the_full_code_flow_logs_in_and_creates_the_membership(client, live_provider):
    fake, registration = live_provider
    params = _start(client, registration)
    assert params["client_id"] == "portal-client" and params["code_challenge_method"] == "S256"
    fake.id_token = _id_token(fake, nonce=params["nonce"])
    response = client.get("/sso/callback/", {"code": "c0de", "state": params["state"]})
    assert response.status_code == 302 and response["Location"] == "/after-login/"
    user = get_user_model().objects.get(email="emp@acme.example")
    assert Membership.objects.get(user=user).tenant_id == registration.tenant_id
    assert client.session["_auth_user_id"] == str(user.pk)
    assert fake.token_requests[0]["code_verifier"]  # PKCE


@pytest.mark.parametrize("bad", [{"aud": "someone-else"}, {"iss": "https://evil.example/"},
                                 {"nonce": "replayed"}, {"exp": int(time.time()) - 600}])
def test_a_bad_id_token_logs_nobody_in(client, live_provider, bad):
    fake, registration = live_provider
    params = _start(client, registration)
    fake.id_token = _id_token(fake, **({"nonce": params["nonce"]} | bad))
    client.get("/sso/callback/", {"code": "c0de", "state": params["state"]})
    assert "_auth_user_id" not in client.session
    assert not get_user_model().objects.filter(email="emp@acme.example").exists()


def test_sso_login_for_a_provider_without_sso_is_404(client, live_provider):
    _, registration = live_provider
    registration.sso_enabled = False
    registration.save()
    assert client.get(f"/sso/{registration.pk}/login/").status_code == 404


def test_first_sso_sign_in_from_an_invitation_accepts_it(client, live_provider, settings):
    """The invitee opens the emailed link, picks the tenant's SSO button, and comes back a
    member with the invited role (above the provider's default)."""
    from django.core import mail

    from tests.worlds import make_user

    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    fake, registration = live_provider
    owner = make_user("live-owner")
    Membership.objects.create(user=owner, tenant=registration.tenant, role="owner")
    inviter = type(client)()
    inviter.force_login(owner)
    inviter.post("/portal/members/", {"email": "emp@acme.example", "role": "billing"})
    link = re.search(r"http://testserver(/portal/invitation/\S+/)", mail.outbox[0].body)[1]
    page = client.get(link).content.decode()
    button = re.search(r'href="(/sso/\d+/login/\?next=[^"]+)"', page)[1].replace("&amp;", "&")
    response = client.get(button)
    params = {k: v[0] for k, v in parse_qs(urlparse(response["Location"]).query).items()}
    fake.id_token = _id_token(fake, nonce=params["nonce"])
    back = client.get("/sso/callback/", {"code": "c0de", "state": params["state"]})
    assert back["Location"] == link  # back to the invitation, now signed in and accepted
    assert client.get(link)["Location"] == "/portal/"
    user = get_user_model().objects.get(email="emp@acme.example")
    assert Membership.objects.get(user=user).role == "billing"
