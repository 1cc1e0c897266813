"""Portal pages with the Django test client: what each role sees, keys shown once, revoke and
rotate, content-logging audit trail, reports (streamed and exported), alerts, tokens."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from metering import metrics
from metering.billing.models import ExportJob, SpendAlert
from tenants.auth import AuthError, authenticate, clear_cache
from tenants.models import ApiKey, ContentLoggingChange, IdentityProvider, ManagementToken, Tenant
from tests.factories import bearer, make_tenant
from tests.worlds import build_world, record, roll_up, this_hour

pytestmark = pytest.mark.django_db
KEY_RE = re.compile(r"igw_[0-9A-Za-z]{43}_[0-9A-Za-z]{6}")

PAGES = ["usage", "requests", "keys", "key_create", "quotas", "playground", "reports", "statement",
         "alerts", "content_logging", "tokens", "members"]
# Who may open which page (others get 403).
ALLOWED = {
    "owner": set(PAGES),
    "member": {"usage", "requests", "keys", "key_create", "quotas", "playground"},
    "billing": {"usage", "requests", "quotas", "reports", "statement", "alerts"},
}


@pytest.fixture
def world(redis_client):
    clear_cache()
    return build_world()


def signed_in(client, world, who):
    client.force_login(world.users[who])
    return client


@pytest.mark.parametrize("who", ["owner", "member", "billing"])
def test_each_role_sees_its_pages(client, world, who):
    signed_in(client, world, who)
    for name in PAGES:
        response = client.get(reverse(f"portal:{name}"))
        assert response.status_code == (200 if name in ALLOWED[who] else 403), name
    nav = client.get(reverse("portal:quotas")).content.decode()
    assert ("Content logging</a>" in nav) == (who == "owner")
    assert ("Reports</a>" in nav) == (who != "member")


def test_sign_in_required_and_outsider_sees_only_their_tenant(client, world):
    assert client.get(reverse("portal:keys")).status_code == 302
    signed_in(client, world, "outsider")
    page = client.get(reverse("portal:keys")).content.decode()
    assert "other key" in page and "owner key" not in page
    refused = client.post(reverse("portal:switch"), {"tenant": world.tenant.id})
    assert refused.status_code == 400
    assert "owner key" not in client.get(reverse("portal:keys")).content.decode()


def test_login_page_signs_in(client, world):
    from tests.worlds import PASSWORD

    response = client.post(reverse("portal:login"), {"username": "owner", "password": PASSWORD})
    assert response.status_code == 302
    assert client.get(reverse("portal:index")).status_code == 302  # -> usage


def test_switching_tenant(client, world):
    second = make_tenant("second")
    second.memberships.create(user=world.users["member"], role="owner")
    signed_in(client, world, "member")
    assert client.get(reverse("portal:tokens")).status_code == 403  # member of acme first
    client.post(reverse("portal:switch"), {"tenant": second.id})
    assert client.get(reverse("portal:tokens")).status_code == 200


def test_created_key_is_shown_once_with_a_warning(client, world):
    signed_in(client, world, "member")
    posted = client.post(reverse("portal:key_create"), {
        "name": "from portal", "allowed_models": [world.model.id], "output_tpm": 500})
    # POST-redirect-GET: the POST's answer holds no secret, so a reload cannot mint another.
    assert posted.status_code == 302 and not KEY_RE.findall(posted.content.decode())
    response = client.get(posted["Location"])
    page = response.content.decode()
    [plaintext] = set(KEY_RE.findall(page))
    assert "only time it is shown" in page and response["Cache-Control"] == "no-store"
    reloaded = client.get(posted["Location"], follow=True).content.decode()
    assert plaintext not in reloaded and "shown once" in reloaded
    assert ApiKey.objects.filter(name="from portal").count() == 1
    key = ApiKey.objects.get(name="from portal")
    assert key.output_tpm == 500 and key.created_by == world.users["member"]
    assert authenticate(bearer(plaintext)).key_id == key.id
    listing = client.get(reverse("portal:keys")).content.decode()
    assert plaintext not in listing and key.prefix in listing and "owner key" not in listing


def test_key_limits_above_the_tenant_are_refused(client, world):
    signed_in(client, world, "owner")
    response = client.post(reverse("portal:key_create"), {"name": "big", "input_tpm": 10**9})
    assert response.status_code == 200 and "above the tenant" in response.content.decode()
    assert not ApiKey.objects.filter(name="big").exists()


def test_revoke_asks_first_then_revokes(client, world):
    signed_in(client, world, "member")
    key, plaintext = world.keys["member"], world.plaintexts["member"]
    url = reverse("portal:key_revoke", args=[key.id])
    assert "cannot be undone" in client.get(url).content.decode()
    key.refresh_from_db()
    assert key.revoked_at is None
    client.post(url)
    with pytest.raises(AuthError):
        authenticate(bearer(plaintext))
    # A member cannot revoke the owner's key.
    assert client.post(reverse("portal:key_revoke", args=[world.keys["owner"].id])).status_code \
        == 404


def test_rotate_gives_a_new_key_and_a_grace_period(client, world):
    signed_in(client, world, "owner")
    old = world.keys["owner"]
    response = client.post(reverse("portal:key_rotate", args=[old.id]), {"grace_seconds": 3600},
                           follow=True)
    [new_plaintext] = set(KEY_RE.findall(response.content.decode()))
    assert "keeps working until" in response.content.decode()
    old.refresh_from_db()
    assert old.expires_at is not None
    assert authenticate(bearer(new_plaintext)).key_id != old.id
    assert authenticate(bearer(world.plaintexts["owner"])).key_id == old.id


def test_usage_page_draws_charts_from_rollups(client, world):
    now = this_hour()
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", now, prompt=1234),
            record(world.tenant, world.keys["member"], "sim-small", now, prompt=10, ttft=300))
    signed_in(client, world, "owner")
    page = client.get(reverse("portal:usage") + "?by=key").content.decode()
    assert page.count("<canvas") == 5 and 'data-series="owner key' in page
    assert "p50 210 ms" in page  # percentile_cont of 120 and 300
    assert "1,244" in page  # input tokens of the range, with a thousands separator
    member_page = signed_in(client, world, "member").get(
        reverse("portal:usage") + "?by=key").content.decode()
    assert 'data-series="member key' in member_page and "owner key" not in member_page


def test_content_logging_switch_is_audited(client, world):
    signed_in(client, world, "owner")
    url = reverse("portal:content_logging")
    assert "AES-256-GCM" in client.get(url).content.decode()
    client.post(url, {"enabled": "on"})  # without the confirmation: refused
    assert not Tenant.objects.get(pk=world.tenant.pk).content_logging
    client.post(url, {"enabled": "on", "confirm": "on"})
    client.post(url, {"enabled": "on", "confirm": "on"})  # no change, no audit row
    client.post(url, {"confirm": "on"})
    assert not Tenant.objects.get(pk=world.tenant.pk).content_logging
    trail = list(ContentLoggingChange.objects.filter(tenant=world.tenant)
                 .values_list("enabled", "changed_by__username"))
    assert trail == [(False, "owner"), (True, "owner")]
    assert "turned on" in client.get(url).content.decode()


def test_the_response_cache_switch_is_audited_and_reaches_the_next_request(client, world):
    """The owner switches the response cache on the same page; its row names the setting, and
    the key's next authentication (every gateway's cached principal) sees it on."""
    from tenants.auth import authenticate

    plaintext = world.plaintexts["owner"]
    assert not authenticate(f"Bearer {plaintext}").response_cache
    signed_in(client, world, "owner")
    url = reverse("portal:content_logging")
    client.post(url, {"setting": "response_cache", "enabled": "on"})  # unconfirmed: refused
    assert not Tenant.objects.get(pk=world.tenant.pk).response_cache
    client.post(url, {"setting": "response_cache", "enabled": "on", "confirm": "on"})
    tenant = Tenant.objects.get(pk=world.tenant.pk)
    assert tenant.response_cache and not tenant.content_logging  # only the one it named
    assert authenticate(f"Bearer {plaintext}").response_cache
    trail = list(ContentLoggingChange.objects.filter(tenant=world.tenant)
                 .values_list("setting", "enabled"))
    assert trail == [("response_cache", True)]
    assert "response cache turned on" in client.get(url).content.decode()
    client.post(url, {"setting": "bogus", "enabled": "on", "confirm": "on"})  # refused
    assert ContentLoggingChange.objects.filter(tenant=world.tenant).count() == 1
    for seat in ("member", "billing"):  # not their decision
        signed_in(client, world, seat)
        assert client.post(url, {"setting": "response_cache", "confirm": "on"}).status_code == 403
    assert Tenant.objects.get(pk=world.tenant.pk).response_cache


def test_small_report_downloads_as_csv(client, world):
    now = this_hour()
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", now, prompt=42))
    signed_in(client, world, "billing")
    response = client.post(reverse("portal:reports"), {
        "start": (now - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M"),
        "end": (now + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M"),
        "group_by": ["model"], "format": "csv"})
    text = b"".join(response.streaming_content).decode()
    assert response["Content-Disposition"].startswith("attachment")
    assert text.splitlines()[-1].startswith("TOTAL,1,42,")


def test_large_report_runs_as_a_celery_task_with_progress(client, world, settings, tmp_path,
                                                          django_capture_on_commit_callbacks):
    from gateway.celery import app

    settings.MEDIA_ROOT = tmp_path
    settings.EXPORT_INLINE_MAX_ROWS = 1
    now = this_hour()
    roll_up(*[record(world.tenant, world.keys["owner"], "sim-small", now - timedelta(hours=h))
              for h in range(3)])
    signed_in(client, world, "owner")
    app.conf.task_always_eager = True
    try:
        with django_capture_on_commit_callbacks(execute=True):
            response = client.post(reverse("portal:reports"), {
                "start": (now - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M"),
                "end": (now + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M"),
                "group_by": ["model"], "format": "xlsx"})
    finally:
        app.conf.task_always_eager = False
    job = ExportJob.objects.get()
    assert response.status_code == 302 and response["Location"].endswith(f"/exports/{job.pk}/")
    assert (job.status, job.progress, job.rows_done) == ("done", 100, 3)
    status = client.get(reverse("portal:export_status", args=[job.pk])).json()
    assert status["status"] == "done"
    download = client.get(reverse("portal:export_download", args=[job.pk]))
    assert b"".join(download.streaming_content)[:2] == b"PK"
    # Another tenant's owner cannot see it.
    signed_in(client, world, "outsider")
    assert client.get(reverse("portal:export_status", args=[job.pk])).status_code == 404


def test_statement_page_and_files(client, world):
    now = this_hour()
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", now, completion=77))
    signed_in(client, world, "billing")
    url = reverse("portal:statement") + f"?month={now:%Y-%m}"
    assert "77" in client.get(url).content.decode()
    assert client.get(url + "&format=xlsx").content[:2] == b"PK"


def test_alerts_and_tokens_pages_create_things(client, world):
    signed_in(client, world, "owner")
    client.post(reverse("portal:alerts"), {"metric": "money", "period": "month",
                                           "threshold": "50", "api_key": ""})
    assert SpendAlert.objects.get().tenant == world.tenant
    response = client.post(reverse("portal:tokens"), {"name": "ci", "role": "billing",
                                                      "expires_in_days": 30}, follow=True)
    assert "only time it is shown" in response.content.decode()
    # POST-redirect-GET: a reload shows nothing and mints nothing.
    again = client.get(reverse("portal:token_created"), follow=True).content.decode()
    assert "shown once" in again and "only time it is shown" not in again
    token = ManagementToken.objects.get()
    assert token.role == "billing" and token.created_by == world.users["owner"]
    assert timedelta(days=29) < token.expires_at - timezone.now() <= timedelta(days=30)


def test_tokens_page_offers_the_default_expiry_and_shows_last_use(client, world, settings):
    """Before: a token without an expiry was the default, and nothing said when it was used."""
    settings.MANAGEMENT_TOKEN_DEFAULT_DAYS = 45
    signed_in(client, world, "owner")
    form = client.get(reverse("portal:tokens")).content.decode()
    assert 'name="expires_in_days" value="45"' in form
    refused = client.post(reverse("portal:tokens"), {"name": "ci", "role": "billing",
                                                     "expires_in_days": ""})
    assert refused.status_code == 200 and not ManagementToken.objects.exists()
    client.post(reverse("portal:tokens"), {"name": "ci", "role": "billing",
                                           "expires_in_days": 45})
    token = ManagementToken.objects.get()
    ManagementToken.objects.filter(pk=token.pk).update(
        last_used_at=timezone.now().replace(year=2026, month=11, day=30, hour=8, minute=15))
    page = client.get(reverse("portal:tokens")).content.decode()
    assert "2026-11-30 08:15" in page and f"{token.expires_at:%Y-%m-%d %H:%M}" in page
    assert "active" in page
    world.tenant.memberships.filter(user=world.users["owner"]).update(role="member")
    world.tenant.memberships.filter(role="billing").update(role="owner")
    signed_in(client, world, "billing")
    assert "its maker is no longer an owner" in client.get(reverse("portal:tokens")).content \
        .decode()


def test_playground_mints_a_short_lived_key(client, world):
    signed_in(client, world, "member")
    body = client.post(reverse("portal:playground_key")).json()
    principal = authenticate(bearer(body["key"]))
    assert principal.tenant_id == world.tenant.id
    key = ApiKey.objects.get(pk=principal.key_id)
    assert key.expires_at is not None and key.created_by == world.users["member"]
    signed_in(client, world, "billing")
    assert client.post(reverse("portal:playground_key")).status_code == 403


def test_members_page_changes_roles_and_keeps_an_owner(client, world):
    signed_in(client, world, "owner")
    billing = world.tenant.memberships.get(role="billing")
    client.post(reverse("portal:member_change", args=[billing.id]), {"role": "member"})
    billing.refresh_from_db()
    assert billing.role == "member"
    mine = world.tenant.memberships.get(user=world.users["owner"])
    page = client.get(reverse("portal:members")).content.decode()
    assert "The last owner" in page  # no control offered that would be refused
    for role in ("remove", "member"):
        page = client.post(reverse("portal:member_change", args=[mine.id]), {"role": role},
                           follow=True).content.decode()
        assert "last owner" in page
        mine.refresh_from_db()
        assert mine.role == "owner"
    client.post(reverse("portal:member_change", args=[billing.id]), {"role": "remove"})
    assert not world.tenant.memberships.filter(pk=billing.id).exists()
    # Another tenant's membership is out of reach.
    theirs = world.other.memberships.get()
    assert client.post(reverse("portal:member_change", args=[theirs.id]),
                       {"role": "remove"}).status_code == 404


def test_an_owner_demoting_themselves_is_asked_first_and_lands_on_a_page(client, world):
    """Before: one click demoted them and the redirect answered a bare 403."""
    world.tenant.memberships.filter(role="member").update(role="owner")  # a second owner
    signed_in(client, world, "owner")
    mine = world.tenant.memberships.get(user=world.users["owner"])
    url = reverse("portal:member_change", args=[mine.id])
    asked = client.post(url, {"role": "billing"})
    assert asked.status_code == 200 and "Are you sure" in asked.content.decode()
    mine.refresh_from_db()
    assert mine.role == "owner"
    done = client.post(url, {"role": "billing", "confirm": "yes"}, follow=True)
    assert done.status_code == 200 and done.redirect_chain[-1][0] == reverse("portal:usage")
    mine.refresh_from_db()
    assert mine.role == "billing"


def test_staff_without_a_membership_sees_no_tenant_page(client, world):
    """Platform staff (even a superuser) have no portal tenant: every page sends them to the
    no-tenant page, and no object of acme is reachable by id."""
    for who in ("staff", "admin"):
        signed_in(client, world, who)
        for name in PAGES:
            response = client.get(reverse(f"portal:{name}"))
            assert response.status_code == 302, (who, name)
            assert response["Location"] == reverse("portal:no_tenant")
        assert client.get(reverse("portal:no_tenant")).status_code == 403
        key = world.keys["owner"]
        client.post(reverse("portal:key_revoke", args=[key.pk]))
        key.refresh_from_db()
        assert key.revoked_at is None
        assert client.post(reverse("portal:switch"), {"tenant": world.tenant.id}).status_code \
            == 400


def test_login_page_offers_the_tenants_sso_providers(client, world):
    provider = IdentityProvider.objects.create(
        tenant=world.tenant, name="Acme Okta", issuer="https://idp.example.test",
        sso_enabled=True, sso_client_id="portal",
        sso_authorization_endpoint="https://idp.example.test/authorize",
    )
    page = client.get(reverse("portal:login") + "?tenant=acme").content.decode()
    assert "Acme Okta" in page and reverse("sso:login", args=[provider.pk]) in page
    assert "Acme Okta" not in client.get(reverse("portal:login")).content.decode()
    assert "Acme Okta" not in client.get(reverse("portal:login") + "?tenant=other").content.decode()


def test_usage_page_lists_this_tenants_429s_by_reason(client, world, redis_client):
    redis_client.hincrby(metrics.rejected_key(), f"{world.tenant.id}|sim-small|tokens", 3)
    redis_client.hincrby(metrics.rejected_key(), f"{world.tenant.id}|sim-small|concurrency", 1)
    redis_client.hincrby(metrics.rejected_key(), f"{world.other.id}|sim-small|secret-reason", 9)
    page = signed_in(client, world, "billing").get(reverse("portal:usage")).content.decode()
    section = page[page.index('id="rejections"'):]
    assert '<td>tokens</td><td class="n">3</td>' in section
    assert '<td>concurrency</td><td class="n">1</td>' in section
    assert "secret-reason" not in page
    member = signed_in(client, world, "member").get(reverse("portal:usage")).content.decode()
    assert 'id="rejections"' not in member
