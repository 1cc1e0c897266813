"""Tenant A's content, audit entries, identity providers and certificates are invisible to B."""

from __future__ import annotations

import base64
import time
from datetime import timedelta

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.utils import timezone

from gateway import sso
from gateway.contentlog import breakglass, crypto, store
from gateway.contentlog.models import ContentRecord
from tenants import auth, mtls, oidc
from tenants.auth import AuthError, authenticate_request
from tenants.models import ClientCertificate, IdentityProvider
from tests.factories import make_tenant


@pytest.fixture(autouse=True)
def master(settings):
    settings.CONTENT_LOG_MASTER_KEYS = "k1:" + base64.b64encode(b"i" * 32).decode()
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    crypto.reset_keys()
    auth.clear_cache()
    yield
    crypto.reset_keys()


def jwk_of(key, kid):
    import json
    return json.loads(jwt.get_algorithm_by_name("ES256").to_jwk(key.public_key())) | {"kid": kid}


@pytest.fixture
def two(db, redis_client):
    a, b = make_tenant("tenant-a"), make_tenant("tenant-b")
    ka, kb = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    for tenant, key in ((a, ka), (b, kb)):
        IdentityProvider.objects.create(
            tenant=tenant, name=tenant.slug, issuer=f"https://{tenant.slug}.example/",
            audience="gw", jwks_json={"keys": [jwk_of(key, "k")]}, algorithms=["ES256"],
            sso_enabled=True)
        ClientCertificate.objects.create(tenant=tenant, name="c",
                                         fingerprint_sha256=f"{tenant.pk:064x}")
    t0 = timezone.now()
    store.write_record(a.pk, "a-req", "A-PROMPT", "A-ANSWER", now=t0)
    store.write_record(b.pk, "b-req", "B-PROMPT", "B-ANSWER", now=t0)
    user = get_user_model().objects.create_user("ops", "ops@x.example", "pw", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__endswith="_breakglass"))
    user = get_user_model().objects.get(pk=user.pk)
    grant = breakglass.request_access(user, a, "Investigating abuse report 77 for tenant A.",
                                      t0 - timedelta(hours=1), t0 + timedelta(hours=1),
                                      timedelta(minutes=10))
    return {"a": a, "b": b, "ka": ka, "kb": kb, "user": user, "grant": grant}


def test_query_functions_return_only_the_tenants_own_rows(two):
    a, b = two["a"], two["b"]
    assert set(ContentRecord.objects.for_tenant(b).values_list("request_id", flat=True)) == \
        {"b-req"}
    assert list(breakglass.audit_entries_for_tenant(b)) == []
    assert {e.tenant_id for e in breakglass.audit_entries_for_tenant(a)} == {a.pk}
    assert list(breakglass.grants_for_tenant(b)) == []
    assert [p.tenant_id for p in oidc.providers_for_tenant(b)] == [b.pk]
    assert [p.tenant_id for p in sso.sso_providers_for_tenant(b)] == [b.pk]
    assert [c.tenant_id for c in mtls.bindings_for_tenant(b)] == [b.pk]


def test_a_grant_on_a_never_decrypts_bs_records(two, settings):
    settings.BREAKGLASS_SELF_APPROVAL = True
    grant = breakglass.approve(two["grant"], two["user"])
    assert [r.request_id for r in breakglass.records_in_scope(grant)] == ["a-req"]
    b_record = ContentRecord.objects.get(request_id="b-req")
    records = breakglass.read_records(grant, two["user"], record_ids=[str(b_record.pk)])
    assert records == []
    read = breakglass.read_records(grant, two["user"])
    assert [(r.prompt, r.response) for r in read] == [("A-PROMPT", "A-ANSWER")]
    assert list(breakglass.audit_entries_for_tenant(two["b"])) == []


def test_a_ciphertext_moved_onto_another_tenants_row_does_not_open(two):
    a_row = ContentRecord.objects.get(request_id="a-req")
    b_row = ContentRecord.objects.get(request_id="b-req")
    b_row.ciphertext = a_row.ciphertext
    with pytest.raises(crypto.DecryptionError):
        store.decrypt_record(b_row)


def _tok(key, iss):
    now = int(time.time())
    return jwt.encode({"iss": iss, "aud": "gw", "sub": "x", "exp": now + 60}, key,
                      algorithm="ES256", headers={"kid": "k"})


def test_tokens_map_to_the_registrations_tenant_and_never_cross(two):
    a, b = two["a"], two["b"]
    ok_a = authenticate_request({"Authorization": f"Bearer {_tok(two['ka'], a_iss(a))}"}, None)
    assert ok_a.tenant_id == a.pk
    # B signs a token claiming A's issuer: verified against A's keys, so refused.
    with pytest.raises(AuthError):
        authenticate_request({"Authorization": f"Bearer {_tok(two['kb'], a_iss(a))}"}, None)
    ok_b = authenticate_request({"Authorization": f"Bearer {_tok(two['kb'], a_iss(b))}"}, None)
    assert ok_b.tenant_id == b.pk and ok_b.key_id != ok_a.key_id


def a_iss(tenant):
    return f"https://{tenant.slug}.example/"


def test_the_sso_mapping_only_grants_membership_in_the_providers_tenant(two):
    provider_b = oidc.providers_for_tenant(two["b"])[0]
    user = sso.map_sso_user(provider_b, {"sub": "someone"})
    assert list(user.memberships.values_list("tenant_id", flat=True)) == [two["b"].pk]
