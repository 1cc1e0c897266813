"""Getting started and keys after creation, with the Django test client: the overview page
(base URL, keys, models with their price, snippets), the snippet with a new key, the docs
link, key editing, who created a key, retiring keys and the playground key. Each new page is
tried from every seat: owner, member, billing, outsider and staff without permissions."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from gateway.portal.playground import playground_key
from metering.billing.models import Price
from tenants.api_keys import rotate_key
from tenants.auth import clear_cache
from tenants.models import ApiKey
from tests.factories import make_model, make_pool
from tests.worlds import build_world, price, this_hour

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(redis_client, settings):
    clear_cache()
    return build_world()


def as_user(client, world, who):
    client.force_login(world.users[who])
    return client


def test_overview_shows_base_url_keys_models_prices_and_snippets(client, world):
    price("sim-small", this_hour() - timedelta(days=1), "0.5", "0.05", "1.5")
    make_pool(make_model("sim-unpriced"), name="unpriced-pool")
    page = as_user(client, world, "member").get(reverse("portal:overview")).content.decode()
    assert "http://testserver/v1" in page
    assert world.keys["member"].masked in page and world.keys["owner"].masked not in page
    row = page[page.index('data-model="sim-small"'):]
    row = row[:row.index("</tr>")]
    assert "0.50 USD" in row and "0.05 USD" in row and "1.50 USD" in row
    assert "0.500000" not in page
    assert "no price set" in page[page.index('data-model="sim-unpriced"'):]
    for snippet in ("snippet-curl", "snippet-python", "snippet-js"):
        code = re.search(rf'<pre id="{snippet}"><code>(.*?)</code>', page, re.S).group(1)
        assert "http://testserver/v1" in code and "sim-small" in code
    assert "OPENAI_API_KEY" in page  # no key in a snippet meant to be pasted anywhere
    # The docs: the /v1 description first, then the management API.
    assert f'href="{reverse("api:redoc_inference")}"' in page


def test_overview_for_every_seat(client, world):
    url = reverse("portal:overview")
    for who in ("owner", "member", "billing"):
        assert as_user(client, world, who).get(url).status_code == 200, who
    billing = client.get(url).content.decode()
    assert "Create a key" not in billing  # billing makes no keys
    # The outsider sees their own tenant's page, never acme's keys.
    outsider = as_user(client, world, "outsider").get(url).content.decode()
    assert world.keys["owner"].masked not in outsider and "Other" in outsider
    staff = as_user(client, world, "staff").get(url)
    assert staff.status_code == 302 and staff["Location"] == reverse("portal:no_tenant")
    client.logout()
    assert client.get(url).status_code == 302  # to the sign-in page


def test_someone_without_a_key_starts_on_the_overview(client, world):
    ApiKey.objects.filter(created_by=world.users["member"]).delete()
    assert as_user(client, world, "member").get("/portal/")["Location"] == reverse(
        "portal:overview")
    assert as_user(client, world, "owner").get("/portal/")["Location"] == reverse("portal:usage")
    assert as_user(client, world, "billing").get("/portal/")["Location"] == reverse(
        "portal:usage")


def test_the_new_key_page_shows_a_snippet_with_that_key(client, world):
    as_user(client, world, "member")
    client.post(reverse("portal:key_create"), {"name": "fresh"})
    page = client.get(reverse("portal:key_created")).content.decode()
    plaintext = re.search(r'<code id="new-key">([^<]+)</code>', page).group(1)
    curl = re.search(r'<pre id="snippet-curl"><code>(.*?)</code>', page, re.S).group(1)
    assert f"Bearer {plaintext}" in curl and "sim-small" in curl
    assert plaintext in re.search(r'<pre id="snippet-python"><code>(.*?)</code>', page,
                                  re.S).group(1)


def test_redoc_pages_link_both_descriptions(client, world):
    page = client.get(reverse("api:redoc_inference")).content.decode()
    assert '"/v1/openapi.json"' in page and 'href="/api/redoc/"' in page
    assert "cdn" not in page.lower()


def test_edit_a_keys_name_models_and_limits(client, world):
    key = world.keys["member"]
    other = make_model("sim-other")
    make_pool(other, name="other-pool")
    url = reverse("portal:key_edit", args=[key.pk])
    as_user(client, world, "member")
    assert client.get(url).status_code == 200
    answer = client.post(url, {"name": "renamed", "allowed_models": [other.pk],
                               "input_tpm": 500, "max_output_tokens": 64})
    assert answer.status_code == 302, answer.content.decode()
    key.refresh_from_db()
    assert key.name == "renamed" and key.input_tpm == 500 and key.max_output_tokens == 64
    assert [m.name for m in key.allowed_models.all()] == ["sim-other"]
    # Emptying a limit gives the tenant's back; a cap above the tenant's quota is refused.
    client.post(url, {"name": "renamed"})
    key.refresh_from_db()
    assert key.input_tpm is None and not key.allowed_models.exists()
    refused = client.post(url, {"name": "renamed", "input_tpm": 10**12})
    assert refused.status_code == 200 and "errorlist" in refused.content.decode()
    assert client.post(url, {"name": "playground · me"}).status_code == 200  # reserved


def test_key_edit_for_every_seat(client, world):
    mine = reverse("portal:key_edit", args=[world.keys["member"].pk])
    owners = reverse("portal:key_edit", args=[world.keys["owner"].pk])
    assert as_user(client, world, "owner").get(mine).status_code == 200  # owner: every key
    assert as_user(client, world, "member").get(owners).status_code == 404  # not theirs
    assert as_user(client, world, "billing").get(mine).status_code == 403
    assert as_user(client, world, "outsider").get(mine).status_code == 404
    assert as_user(client, world, "staff").get(mine).status_code == 302  # no tenant
    world.keys["member"].revoke()
    assert as_user(client, world, "member").get(mine).status_code == 404  # revoked: nothing


def test_keys_page_shows_creator_retiring_keys_and_the_playground_key(client, world):
    old = world.keys["owner"]
    rotate_key(old, timedelta(hours=1), created_by=world.users["owner"])
    as_user(client, world, "owner")
    playground_key(client.session, world.tenant, world.users["owner"])
    page = client.get(reverse("portal:keys")).content.decode()
    row = page[page.index(f'data-key="{old.prefix}"'):]
    row = row[:row.index("</tr>")]
    assert "retiring until" in row and "Rotate" not in row and "Revoke" in row
    assert 'data-label="Created by">owner<' in row
    pg = ApiKey.objects.get(name="playground · owner")
    pg_row = page[page.index(f'data-key="{pg.prefix}"'):]
    pg_row = pg_row[:pg_row.index("</tr>")]
    assert ">playground</span>" in pg_row and "Rotate" not in pg_row and "Edit" not in pg_row
    # Rotating a retiring key again is refused (its successor is the one to rotate).
    assert client.post(reverse("portal:key_rotate", args=[old.pk]),
                       {"grace_seconds": 0}).status_code == 404
    old.refresh_from_db()
    assert old.rotated_at is not None and old.expires_at > timezone.now()


# --- prices in the admin ------------------------------------------------------------------

def price_form(model="sim-small", currency="USD", start=None, inp="0.5"):
    start = start or this_hour() + timedelta(hours=2)
    return {"model_name": model, "currency": currency, "input_per_mtok": inp,
            "cached_input_per_mtok": "0.05", "output_per_mtok": "1.5",
            "effective_from": start.strftime("%Y-%m-%dT%H:%M")}


@pytest.fixture
def admin_client(client, world):
    client.force_login(world.users["admin"])
    return client


def test_admin_prices_pick_model_and_currency_from_lists(admin_client):
    add = reverse("admin:billing_price_add")
    page = admin_client.get(add).content.decode()
    assert '<option value="sim-small">' in page and '<option value="EUR">' in page
    default = re.search(r'name="effective_from" value="([^"]+)"', page).group(1)
    assert default.endswith(":00") and default == (this_hour() + timedelta(hours=1)).strftime(
        "%Y-%m-%dT%H:%M")  # the default start is on the hour, so it saves as it is
    for bad in (price_form(model="sim-smal"), price_form(currency="usd"),
                price_form(start=this_hour() - timedelta(hours=1)),
                price_form(start=this_hour() + timedelta(hours=1, minutes=30))):
        answer = admin_client.post(add, bad)
        assert answer.status_code == 200 and "errorlist" in answer.content.decode(), bad
    assert not Price.objects.exists()
    assert admin_client.post(add, price_form()).status_code == 302
    listing = admin_client.get(reverse("admin:billing_price_changelist")).content.decode()
    assert "0.50 USD" in listing and "0.500000" not in listing


def test_a_future_price_can_be_corrected_or_deleted_a_past_one_never(admin_client):
    future = price("sim-small", this_hour() + timedelta(hours=3), "9", "0", "9")
    past = price("sim-small", this_hour() - timedelta(days=1), "0.5", "0", "1")
    change = reverse("admin:billing_price_change", args=[future.pk])
    assert admin_client.post(change, price_form(inp="0.7",
                                                start=future.effective_from)).status_code == 302
    future.refresh_from_db()
    assert str(future.input_per_mtok).startswith("0.7")
    delete = reverse("admin:billing_price_delete", args=[future.pk])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 302
    assert not Price.objects.filter(pk=future.pk).exists()
    # The past price: read-only, no delete.
    admin_client.post(reverse("admin:billing_price_change", args=[past.pk]), price_form(inp="7"))
    admin_client.post(reverse("admin:billing_price_delete", args=[past.pk]), {"post": "yes"})
    past.refresh_from_db()
    assert str(past.input_per_mtok).startswith("0.5")


def test_api_prices_corrected_only_before_they_take_effect(client, world):
    future = price("sim-small", this_hour() + timedelta(hours=3), "9", "0", "9")
    past = price("sim-small", this_hour() - timedelta(days=1), "0.5", "0", "1")
    client.force_login(world.users["admin"])
    assert client.patch(f"/api/prices/{future.pk}/", {"input_per_mtok": "0.7"},
                        content_type="application/json").status_code == 200
    refused = client.patch(f"/api/prices/{past.pk}/", {"input_per_mtok": "7"},
                           content_type="application/json")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "effective_from"
    assert client.delete(f"/api/prices/{past.pk}/").status_code == 400
    assert client.delete(f"/api/prices/{future.pk}/").status_code == 204
    for who in ("owner", "member", "billing", "outsider", "staff"):
        client.force_login(world.users[who])
        assert client.delete(f"/api/prices/{past.pk}/").status_code == 403, who
    assert Price.objects.filter(pk=past.pk).exists()
