"""OIDC bearer tokens for the inference API, against a local JWKS endpoint with test keys."""

from __future__ import annotations

import json
import time

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from django.core.exceptions import ValidationError

from tenants import oidc
from tenants.auth import AuthError, authenticate_request
from tenants.models import IdentityProvider
from tests.factories import bearer, make_key, make_tenant
from tests.oidc_provider import AUDIENCE, ISSUER, call, fresh_jwks, public_jwk, token

INVALID = {"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                     "param": None, "code": "invalid_api_key"}}


@pytest.fixture(scope="module")
def rsa_key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def rsa_key2():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture
def jwks(rsa_key, settings):
    settings.OIDC_JWKS_MIN_REFRESH_SECONDS = 30.0
    with fresh_jwks([public_jwk(rsa_key, "k1", "RS256")]) as server:
        yield server


@pytest.fixture
def idp(db, redis_client, jwks):
    tenant = make_tenant("acme")
    return IdentityProvider.objects.create(
        tenant=tenant, name="Acme SSO", issuer=ISSUER, audience=AUDIENCE, jwks_url=jwks.url,
        algorithms=["RS256", "ES256"],
    )


def rejected(tok: str) -> AuthError:
    with pytest.raises(AuthError) as err:
        call(tok)
    assert err.value.status == 401 and err.value.body == INVALID
    return err.value


def test_a_valid_token_maps_to_the_registrations_tenant(idp, rsa_key):
    principal = call(token(rsa_key, tenant="someone-else", org_id=999))
    assert principal.tenant_id == idp.tenant_id
    assert principal.key_id == oidc.synthetic_key_id(idp.pk) < 0
    assert principal.key_prefix == f"oidc:{idp.pk}"
    assert principal.limits().input_tpm == 200_000  # the tenant's quota


def test_expired(idp, rsa_key):
    rejected(token(rsa_key, exp=int(time.time()) - 3600, iat=int(time.time()) - 7200,
                   nbf=int(time.time()) - 7200))


def test_not_yet_valid(idp, rsa_key):
    rejected(token(rsa_key, nbf=int(time.time()) + 3600))


def test_missing_exp(idp, rsa_key):
    rejected(token(rsa_key, exp=None))


def test_wrong_audience(idp, rsa_key):
    rejected(token(rsa_key, aud="another-app"))


def test_wrong_issuer(idp, rsa_key):
    rejected(token(rsa_key, iss="https://evil.example/"))


def test_unknown_kid(idp, rsa_key2):
    rejected(token(rsa_key2, kid="not-published"))


def test_signed_by_another_key_under_a_known_kid(idp, rsa_key2):
    rejected(token(rsa_key2, kid="k1"))


def test_tampered_payload(idp, rsa_key):
    header, payload, signature = token(rsa_key).split(".")
    claims = json.loads(jwt.utils.base64url_decode(payload))
    claims["sub"] = "admin"
    forged = jwt.utils.base64url_encode(json.dumps(claims).encode()).decode()
    rejected(f"{header}.{forged}.{signature}")


def test_alg_none(idp):
    now = int(time.time())
    rejected(jwt.encode({"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "exp": now + 60},
                        None, algorithm="none", headers={"kid": "k1"}))


def test_hs256_with_the_public_key_as_secret(idp, rsa_key):
    # The classic algorithm-confusion forgery: HMAC keyed with the published public key.
    pem = rsa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
    header = jwt.utils.base64url_encode(json.dumps({"alg": "HS256", "kid": "k1"}).encode())
    now = int(time.time())
    body = jwt.utils.base64url_encode(json.dumps(
        {"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "exp": now + 60}).encode())
    import hashlib
    import hmac
    sig = hmac.new(pem, header + b"." + body, hashlib.sha256).digest()
    rejected(f"{header.decode()}.{body.decode()}.{jwt.utils.base64url_encode(sig).decode()}")


def test_an_algorithm_the_registration_does_not_allow(idp, rsa_key):
    rejected(token(rsa_key, alg="RS512"))


def test_the_provider_rotating_keys_is_picked_up_at_once(idp, jwks, rsa_key, rsa_key2, settings):
    settings.OIDC_JWKS_MIN_REFRESH_SECONDS = 0.0
    call(token(rsa_key))
    jwks.keys = [public_jwk(rsa_key2, "k2", "RS256")]
    assert call(token(rsa_key2, kid="k2")).tenant_id == idp.tenant_id
    assert jwks.fetches == 2


def test_keys_are_cached_and_unknown_kids_cannot_hammer_the_provider(idp, jwks, rsa_key):
    for _ in range(5):
        call(token(rsa_key))
    assert jwks.fetches == 1
    for i in range(5):
        rejected(token(rsa_key, kid=f"random-{i}"))
    assert jwks.fetches == 1  # refresh on unknown kid is rate limited


def test_an_uploaded_jwks_with_es256(db, redis_client):
    key = ec.generate_private_key(ec.SECP256R1())
    provider = IdentityProvider.objects.create(
        tenant=make_tenant(), name="uploaded", issuer=ISSUER, audience="other-aud",
        jwks_json={"keys": [public_jwk(key, "e1", "ES256")]}, algorithms=["ES256"],
    )
    principal = call(token(key, kid="e1", alg="ES256", aud="other-aud"))
    assert principal.tenant_id == provider.tenant_id
    rejected(token(key, kid="e1", alg="ES256", aud=AUDIENCE))  # no registration for it


def test_an_rsa_key_cannot_verify_an_es256_token(idp, jwks, rsa_key):
    ec_key = ec.generate_private_key(ec.SECP256R1())
    rejected(token(ec_key, kid="k1", alg="ES256"))


def test_a_disabled_registration_accepts_nothing_even_when_cached(idp, rsa_key):
    call(token(rsa_key))  # caches the registration in this process
    idp.api_enabled = False
    idp.save()
    rejected(token(rsa_key))


def test_api_keys_still_work_through_authenticate_request(idp):
    _, plaintext = make_key(idp.tenant)
    assert authenticate_request({"authorization": bearer(plaintext)}, None).tenant_id == \
        idp.tenant_id


def test_a_suspended_tenant_gets_403(idp, rsa_key):
    idp.tenant.set_status("suspended")
    with pytest.raises(AuthError) as err:
        call(token(rsa_key))
    assert err.value.status == 403


@pytest.mark.parametrize("algs", [["HS256"], ["none"], [], ["RS256", "HS512"]])
def test_registrations_refuse_symmetric_or_no_algorithms(db, algs):
    provider = IdentityProvider(tenant=make_tenant(), name="x", issuer=ISSUER, audience="a",
                                jwks_url="https://idp.example/jwks", algorithms=algs)
    with pytest.raises(ValidationError):
        provider.clean()


def test_one_issuer_and_audience_belongs_to_one_tenant(idp):
    from django.db import IntegrityError, transaction

    with pytest.raises(IntegrityError), transaction.atomic():
        IdentityProvider.objects.create(tenant=make_tenant(), name="squat", issuer=ISSUER,
                                        audience=AUDIENCE, jwks_url=idp.jwks_url)


def test_the_admin_never_renders_the_sso_client_secret(db, client):
    from django.contrib.auth import get_user_model
    provider = IdentityProvider.objects.create(
        tenant=make_tenant(), name="x", issuer=ISSUER, audience="a",
        jwks_url="https://idp.example/jwks", sso_client_secret="VERY-SECRET-VALUE")
    client.force_login(get_user_model().objects.create_superuser("root", "r@x.example", "pw"))
    page = client.get(f"/admin/tenants/identityprovider/{provider.pk}/change/")
    assert page.status_code == 200 and b"VERY-SECRET-VALUE" not in page.content
