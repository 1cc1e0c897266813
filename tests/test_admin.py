"""The platform admin: every page loads, keys are issued once and revoked, bad quotas refused."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth import get_user_model
from django.contrib.sessions.models import Session
from django.urls import reverse

from catalog.models import Pool, ServedModel
from infra import sealed_once
from tenants.api_keys import hash_key
from tenants.auth import AuthError, authenticate, clear_cache
from tenants.models import ApiKey, Membership, Quota, Tenant, Tier
from tests.factories import bearer, make_key, make_model, make_pool, make_tenant

KEY_RE = re.compile(r"igw_[0-9A-Za-z]{43}_[0-9A-Za-z]{6}")
MODELS = [Tier, ServedModel, Pool, Tenant, ApiKey, Membership]


@pytest.fixture(autouse=True)
def _fresh_cache(redis_client):
    clear_cache()


@pytest.fixture
def world(admin_user):
    tenant = make_tenant("acme")
    model = make_model()
    pool = make_pool(model, dedicated_to=tenant)
    key, plaintext = make_key(tenant, allowed_models=[model])
    member = Membership.objects.create(user=admin_user, tenant=tenant)
    return {Tier: tenant.tier, ServedModel: model, Pool: pool, Tenant: tenant, ApiKey: key,
            Membership: member, "plaintext": plaintext}


def _url(model, view, *args):
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_{view}", args=args)


@pytest.mark.django_db
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_changelist_add_and_change_pages_load(admin_client, world, model):
    assert admin_client.get(_url(model, "changelist")).status_code == 200
    assert admin_client.get(_url(model, "changelist"), {"q": "acme"}).status_code == 200
    assert admin_client.get(_url(model, "add")).status_code == 200
    response = admin_client.get(_url(model, "change", world[model].pk))
    assert response.status_code == 200
    assert world["plaintext"] not in response.content.decode()


@pytest.mark.django_db
@pytest.mark.parametrize("query", [
    {"state": "active"}, {"state": "expired"}, {"state": "revoked"},
    {"tenant__status__exact": "suspended"}, {"q": "acme"},
])
def test_key_filters_and_search(admin_client, world, query):
    response = admin_client.get(_url(ApiKey, "changelist"), query)
    assert response.status_code == 200
    listed = world[ApiKey].masked in response.content.decode()
    assert listed == (query.get("state") in (None, "active")
                      and "tenant__status__exact" not in query)


@pytest.mark.django_db
def test_key_changelist_shows_masked_key_only(admin_client, world):
    page = admin_client.get(_url(ApiKey, "changelist")).content.decode()
    assert world[ApiKey].masked in page
    assert world["plaintext"] not in page


@pytest.mark.django_db
def test_issue_key_from_admin_shows_it_once(admin_client, world):
    tenant, model = world[Tenant], world[ServedModel]
    response = admin_client.post(_url(ApiKey, "add"), {
        "tenant": tenant.pk, "name": "ci deploy", "allowed_models": [model.pk],
        "expires_at_0": "", "expires_at_1": "", "output_tpm": "1000",
    })
    # POST-redirect-GET: the POST's answer carries no secret; the GET shows it once.
    assert response.status_code == 302 and not KEY_RE.findall(response.content.decode())
    issued_url = response["Location"]
    parked_sessions = [str(s.get_decoded()) for s in Session.objects.all()]
    response = admin_client.get(issued_url)
    assert "no-store" in response["Cache-Control"]
    page = response.content.decode()
    plaintext = KEY_RE.findall(page)
    assert len(set(plaintext)) == 1
    plaintext = plaintext[0]
    # While parked between the POST and the GET, the session store held only ciphertext.
    assert parked_sessions and not any(plaintext in s for s in parked_sessions)
    assert not response.cookies[sealed_once.COOKIE].value  # the browser's half is dropped
    assert "shown only this once" in page and 'id="copy-key"' in page
    reloaded = admin_client.get(issued_url, follow=True).content.decode()
    assert plaintext not in reloaded and "shown once" in reloaded
    assert ApiKey.objects.filter(name="ci deploy").count() == 1

    issued = ApiKey.objects.get(name="ci deploy")
    assert issued.key_hash == hash_key(plaintext, issued.pepper_version)
    assert issued.created_by.username == "admin"
    assert list(issued.allowed_models.all()) == [model] and issued.output_tpm == 1000
    assert authenticate(bearer(plaintext)).key_id == issued.pk
    # Never again: not on the key's page, the list, the tenant's page, nor a later response.
    for url in (_url(ApiKey, "change", issued.pk), _url(ApiKey, "changelist"),
                _url(Tenant, "change", tenant.pk), reverse("admin:index")):
        later = admin_client.get(url).content.decode()
        assert plaintext not in later
        assert issued.masked in later or url == reverse("admin:index")
    assert plaintext not in str(admin_client.cookies)


@pytest.mark.django_db
def test_issue_key_above_tenant_limit_is_refused(admin_client, world):
    response = admin_client.post(_url(ApiKey, "add"), {
        "tenant": world[Tenant].pk, "name": "greedy", "expires_at_0": "", "expires_at_1": "",
        "input_tpm": "999999999",
    })
    assert response.status_code == 200
    assert "above the tenant" in response.content.decode()
    assert not KEY_RE.search(response.content.decode())
    assert not ApiKey.objects.filter(name="greedy").exists()


@pytest.mark.django_db
def test_issue_key_with_past_expiry_is_refused(admin_client, world):
    response = admin_client.post(_url(ApiKey, "add"), {
        "tenant": world[Tenant].pk, "name": "stale",
        "expires_at_0": "2001-01-01", "expires_at_1": "00:00:00",
    })
    assert "must be in the future" in response.content.decode()
    assert not ApiKey.objects.filter(name="stale").exists()


@pytest.mark.django_db
def test_revoke_selected_keys_action(admin_client, world):
    other, other_plain = make_key(world[Tenant], name="other")
    assert authenticate(bearer(world["plaintext"]))  # cached before the revoke
    asked = admin_client.post(_url(ApiKey, "changelist"), {
        "action": "revoke_selected", "_selected_action": [world[ApiKey].pk],
    }).content.decode()
    assert "cannot be undone" in asked and world[ApiKey].masked in asked
    world[ApiKey].refresh_from_db()
    assert world[ApiKey].revoked_at is None  # not before the confirmation
    response = admin_client.post(_url(ApiKey, "changelist"), {
        "action": "revoke_selected", "_selected_action": [world[ApiKey].pk],
        "confirmed": "yes"}, follow=True)
    assert "Revoked 1 key" in response.content.decode()
    world[ApiKey].refresh_from_db()
    assert world[ApiKey].revoked_at is not None
    with pytest.raises(AuthError):
        authenticate(bearer(world["plaintext"]))
    assert authenticate(bearer(other_plain)).key_id == other.pk


@pytest.mark.django_db
def test_suspend_action_refuses_the_tenants_keys(admin_client, world):
    admin_client.post(_url(Tenant, "changelist"), {
        "action": "suspend_selected", "_selected_action": [world[Tenant].pk],
    })
    with pytest.raises(AuthError) as err:
        authenticate(bearer(world["plaintext"]))
    assert err.value.status == 403


def _tenant_form(tier: Tier, **quota: str) -> dict[str, str]:
    data = {
        "name": "Globex", "slug": "globex", "status": "active", "tier": tier.pk,
        "region": "local",
        "quotas-TOTAL_FORMS": "1", "quotas-INITIAL_FORMS": "0",
        "quotas-MIN_NUM_FORMS": "0", "quotas-MAX_NUM_FORMS": "1000",
        "api_keys-TOTAL_FORMS": "0", "api_keys-INITIAL_FORMS": "0",
        "api_keys-MIN_NUM_FORMS": "0", "api_keys-MAX_NUM_FORMS": "0",
        "quotas-0-model": "",
    }
    data.update({f"quotas-0-{k}": v for k, v in quota.items()})
    return data


@pytest.mark.django_db
def test_add_tenant_with_quota_inline(admin_client, world):
    response = admin_client.post(_url(Tenant, "add"), _tenant_form(
        world[Tier], input_tpm="300000", ttft_deadline_s="2", total_deadline_s="60"))
    assert response.status_code == 302, response.content.decode()[:2000]
    quota = Quota.objects.get(tenant__slug="globex", model=None)
    assert (quota.input_tpm, quota.ttft_deadline_s) == (300_000, 2.0)


@pytest.mark.django_db
@pytest.mark.parametrize("quota,message", [
    ({"input_tpm": "-10"}, "greater than or equal to 1"),
    ({"output_tpm": "0"}, "greater than or equal to 1"),
    ({"input_burst": "0"}, "greater than or equal to 1"),
    ({"ttft_deadline_s": "90", "total_deadline_s": "60"}, "cannot exceed the total deadline"),
    ({"output_tpm": "100", "max_output_tokens": "4096"}, "could never be admitted"),
])
def test_admin_rejects_impossible_quotas(admin_client, world, quota, message):
    response = admin_client.post(_url(Tenant, "add"), _tenant_form(world[Tier], **quota))
    assert response.status_code == 200
    assert message in response.content.decode()
    assert not Tenant.objects.filter(slug="globex").exists()


@pytest.mark.django_db
def test_override_checked_against_the_default_edited_beside_it(admin_client, world):
    model = world[ServedModel]
    data = _tenant_form(world[Tier], total_deadline_s="30")
    data.update({"quotas-TOTAL_FORMS": "2", "quotas-1-model": model.pk,
                 "quotas-1-ttft_deadline_s": "45"})
    response = admin_client.post(_url(Tenant, "add"), data)
    assert "cannot exceed the total deadline" in response.content.decode()
    data["quotas-1-ttft_deadline_s"] = "20"
    assert admin_client.post(_url(Tenant, "add"), data).status_code == 302
    assert Quota.objects.filter(tenant__slug="globex").count() == 2


@pytest.mark.django_db
def test_non_staff_cannot_reach_the_admin(client, world):
    user = get_user_model().objects.create_user("outsider", password="pw-outsider-1")
    client.force_login(user)
    response = client.get(_url(ApiKey, "changelist"))
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


@pytest.mark.django_db
def test_edit_key_limits_in_admin_checks_the_tenant(admin_client, world):
    key = world[ApiKey]
    url = _url(ApiKey, "change", key.pk)
    base = {"name": "renamed", "allowed_models": [world[ServedModel].pk],
            "expires_at_0": "", "expires_at_1": ""}
    response = admin_client.post(url, {**base, "open_streams": "10000"})
    assert "above the tenant" in response.content.decode()
    assert admin_client.post(url, {**base, "open_streams": "4"}).status_code == 302
    key.refresh_from_db()
    assert (key.name, key.open_streams) == ("renamed", 4)
    assert authenticate(bearer(world["plaintext"])).key_caps.open_streams == 4
