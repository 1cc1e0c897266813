"""The portal and admin details users notice, with the Django test client: error pages inside
the layout, the current page marked, a tenant switch that keeps the page, one reusable
playground key, alerts that name their currency, admin guard rails, break-glass as text and
API docs that load nothing from elsewhere."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.core import mail
from django.urls import reverse
from django.utils import timezone

from catalog.models import Pool
from gateway.contentlog.display import as_messages
from gateway.portal.playground import PLAYGROUND_KEY_TTL, REUSE_MARGIN, playground_key
from gateway.portal.templatetags.portal_format import money, num, when
from metering.billing import alerts
from metering.billing.models import Price, SpendAlert
from tenants.auth import clear_cache
from tenants.models import ApiKey
from tests import rkeys
from tests.factories import make_tenant
from tests.worlds import build_world, price, record, roll_up, this_hour

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(redis_client, settings):
    clear_cache()
    return build_world()


@pytest.fixture
def admin_client(client, world):
    """The world's superuser (pytest-django's own admin_client would clash on its username)."""
    client.force_login(world.users["admin"])
    return client


def signed_in(client, world, who):
    client.force_login(world.users[who])
    return client


def test_numbers_money_and_times_read_well():
    assert num(1234567) == "1,234,567" and num(2.5) == "2.5" and num(None) == "\u2013"
    assert money(Decimal("1234.5"), "USD") == "1,234.50 USD"
    assert "unpriced" in money(Decimal(0), "")
    moment = timezone.now().replace(microsecond=123456)
    html = when(moment)
    assert 'datetime="' in html and ".123456" not in html.split(">")[1]  # no microseconds


def test_error_pages_are_inside_the_portal_layout(client, world):
    signed_in(client, world, "member")
    missing = client.get("/portal/keys/999999/revoke/")
    page = missing.content.decode()
    assert missing.status_code == 404 and "Page not found" in page
    assert 'href="/portal/usage/"' in page  # the navigation is there
    forbidden = client.get(reverse("portal:tokens"))
    page = forbidden.content.decode()
    assert forbidden.status_code == 403 and "can't open this page" in page
    assert "member of <strong>Acme</strong>" in page and 'href="/portal/playground/"' in page
    anonymous = client.logout() or client.get("/nowhere")
    assert anonymous.status_code == 404 and "Page not found" in anonymous.content.decode()


def test_landing_page_and_favicon(client, world):
    page = client.get("/").content.decode()
    assert 'href="/portal/"' in page and "/api/docs/" in page and "favicon.svg" in page
    icon = client.get("/favicon.ico")
    assert icon.status_code == 301 and icon["Location"].endswith("portal/favicon.svg")


def test_navigation_marks_the_current_section(client, world):
    signed_in(client, world, "owner")
    page = client.get(reverse("portal:key_create")).content.decode()
    [current] = re.findall(r'<a href="([^"]+)" aria-current="page"', page)
    assert current == reverse("portal:keys")


def test_switching_tenant_keeps_the_page(client, world):
    second = make_tenant("second")
    second.memberships.create(user=world.users["owner"], role="billing")
    signed_in(client, world, "owner")
    usage = reverse("portal:usage") + "?range=7d&grain=day&by=key"
    answer = client.post(reverse("portal:switch"), {"tenant": second.id, "next": usage})
    assert answer["Location"] == usage  # same page, same filters
    # A key's page belongs to the old tenant: back to the keys list... which billing cannot
    # open, so the portal's start page.
    client.post(reverse("portal:switch"), {"tenant": world.tenant.id})
    revoke = reverse("portal:key_revoke", args=[world.keys["owner"].id])
    answer = client.post(reverse("portal:switch"), {"tenant": second.id, "next": revoke})
    assert answer["Location"] == reverse("portal:index")
    client.post(reverse("portal:switch"), {"tenant": world.tenant.id})
    answer = client.post(reverse("portal:switch"), {"tenant": world.tenant.id, "next": revoke})
    assert answer["Location"] == reverse("portal:keys")
    answer = client.post(reverse("portal:switch"), {
        "tenant": second.id, "next": "/portal/usage/?range=7d%0D%0ALocation:%20x&by=key"})
    assert answer.status_code == 302 and "\r" not in answer["Location"]
    for hostile in ("https://evil.test/portal/usage/", "//evil.test/", "/admin/"):
        answer = client.post(reverse("portal:switch"), {"tenant": second.id, "next": hostile})
        assert answer["Location"] in (reverse("portal:index"), reverse("portal:usage"))


def test_playground_reuses_one_short_lived_key_per_user(client, world):
    signed_in(client, world, "member")
    url = reverse("portal:playground_key")
    first, second = client.post(url).json(), client.post(url).json()
    assert first["key"] == second["key"] and second["reused"] and not first["reused"]
    mine = ApiKey.objects.filter(tenant=world.tenant, created_by=world.users["member"],
                                 name="playground · member")
    assert mine.count() == 1
    key = mine.get()
    assert key.expires_at <= timezone.now() + PLAYGROUND_KEY_TTL
    # Near its end it is replaced, and the old one revoked: one live key per user.
    session = client.session
    later = timezone.now() + PLAYGROUND_KEY_TTL - REUSE_MARGIN + timedelta(seconds=1)
    renewed = playground_key(session, world.tenant, world.users["member"], now=later)
    assert not renewed.reused and renewed.key.pk != key.pk
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert mine.filter(revoked_at__isnull=True).count() == 1
    # Another user's session never hands out this user's key.
    signed_in(client, world, "owner")
    assert client.post(url).json()["key"] != first["key"]


def test_per_key_usage_and_spend_on_the_keys_page(client, world):
    now = this_hour()
    price("sim-small", now - timedelta(days=1), "1000", "0", "2000")
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", now, prompt=1500,
                   completion=1000))
    signed_in(client, world, "owner")
    page = client.get(reverse("portal:keys")).content.decode()
    row = page[page.index('data-key="' + world.keys["owner"].prefix):]
    row = row[:row.index("</tr>")]
    assert "2,500" in row and "3.50 USD" in row  # 1.50 + 2.00


def test_statement_rows_add_up_to_the_total(client, world):
    now = this_hour()
    price("sim-small", now - timedelta(days=1), "0.53", "0", "0")
    roll_up(*[record(world.tenant, k, "sim-small", now, prompt=10_000, completion=0)
              for k in (world.keys["owner"], world.keys["member"])])
    signed_in(client, world, "owner")
    page = client.get(reverse("portal:statement")).content.decode()
    # Each row costs 0.0053 USD: the total is the exact 0.0106 rounded once (0.01, as every
    # grouping shows it), and the rows are allocated by largest remainder so they add up to
    # it: 0.01 and 0.00 (ADR 0013, amended).
    assert page.count(">0.01 USD<") == 2 and page.count(">0.00 USD<") == 1
    assert ">0.02 USD<" not in page


def test_alerts_name_their_currency(world, settings):
    now = this_hour()
    price("sim-small", now - timedelta(days=1), "1000", "0", "0", currency="EUR")
    alert = SpendAlert.objects.create(tenant=world.tenant, metric="money", period="month",
                                      threshold=Decimal("1.5"), currency="EUR")
    usd = SpendAlert.objects.create(tenant=world.tenant, metric="money", period="month",
                                    threshold=Decimal("0.01"), currency="USD")
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", now, prompt=2000))
    [event] = alerts.check_all(now)  # EUR spend never trips a USD alert
    assert event.alert == alert and event.value_text == "2.00 EUR"
    assert "2.00 EUR" in mail.outbox[0].body and "1.50 EUR" in mail.outbox[0].body
    assert usd.threshold_text == "0.01 USD"


def test_admin_refuses_unknown_backend_settings_naming_the_key(admin_client, world):
    pool = world.pool
    url = reverse("admin:catalog_pool_change", args=[pool.pk])
    form = {"name": pool.name, "model": pool.model_id, "region": pool.region,
            "backend": "simulated", "max_sequences": 8, "kv_cache_tokens": 4096,
            "kv_overcommit": 1, "enabled": "on"}
    bad = admin_client.post(url, {**form, "backend_settings": '{"decode_tokens_per_sec": 5}'})
    assert bad.status_code == 200 and "decode_tokens_per_sec" in bad.content.decode()
    wrong_type = admin_client.post(url, {**form, "backend_settings": '{"seed": "seven"}'})
    assert "&#x27;seed&#x27; has the wrong type" in wrong_type.content.decode()
    upstream = admin_client.post(url, {**form, "backend": "openai_upstream",
                                       "backend_settings": "{}"})
    assert "base_url" in upstream.content.decode()
    good = admin_client.post(url, {**form, "backend_settings": '{"decode_tokens_per_s": 5}'})
    assert good.status_code == 302
    assert Pool.objects.get(pk=pool.pk).backend_settings == {"decode_tokens_per_s": 5}


def test_admin_never_deletes_billing_data(admin_client, world):
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", this_hour()))
    price("sim-small", this_hour() - timedelta(days=1), "1", "1", "1")
    for name in ("metering_usagerecord", "metering_usagerollup", "billing_price",
                 "billing_alertevent", "tenants_apikey"):
        page = admin_client.get(reverse(f"admin:{name}_changelist")).content.decode()
        assert 'value="delete_selected"' not in page, name
    listing = admin_client.get(reverse("admin:metering_usagerecord_changelist")).content.decode()
    assert "Acme" in listing and "owner key" in listing  # names, not ids
    assert "tenant__id__exact" in listing  # a filter by tenant
    past = Price.objects.get()
    assert admin_client.post(reverse("admin:billing_price_delete", args=[past.pk]),
                             {"post": "yes"}).status_code == 403
    assert Price.objects.filter(pk=past.pk).exists()


def test_break_glass_content_reads_as_text():
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    assert as_messages(chat) == [("system", "Be brief."), ("user", "Hello")]
    assert as_messages("plain answer") == [("", "plain answer")]
    assert as_messages(None) == []


def test_break_glass_page_is_in_the_admin_style_with_pickers(admin_client, world):
    page = admin_client.get("/breakglass/").content.decode()
    assert 'id="header"' in page and 'type="datetime-local"' in page
    assert 'id="breakglass-link"' in admin_client.get("/admin/").content.decode()


def test_api_docs_load_nothing_from_other_sites(client, world):
    signed_in(client, world, "owner")
    for path in ("/api/redoc/", "/api/docs/"):
        answer = client.get(path)
        page = answer.content.decode()
        assert answer.status_code == 200, path
        assert not re.findall(r'(?:src|href)="https?://', page), path
        assert "googleapis" not in page
        assert "img-src 'self' data:" in answer["Content-Security-Policy"]


def test_pool_live_status_from_heartbeats(redis_client, settings):
    import time

    from serving import wfq
    from serving.pool_status import pool_state

    settings.WORKER_DEAD_AFTER_SECONDS = 5
    now = time.time()
    redis_client.zadd(rkeys.workers_key("p-live"), {"w-fresh": now - 1, "w-stale": now - 60})
    for wid, running in (("w-fresh", 3), ("w-stale", 9)):
        redis_client.hset(rkeys.worker_key("p-live", wid, "load"), mapping={
            "running": running, "max_running": 8, "kv_tokens_used": 1000,
            "kv_tokens_total": 4000, "waiting": 1, "draining": 0})
    wfq.Wfq(redis_client).enqueue("p-live", "7", "req-a", weight=1.0, prompt_tokens=10,
                                  max_output_tokens=10, kv_tokens=20)
    state = pool_state("p-live")
    assert [w.worker_id for w in state.live_workers] == ["w-fresh"]  # the stale one is not
    assert (state.running, state.max_running, state.kv_percent, state.queued) == (3, 8, 25.0, 1)
    assert state.queued_by_tenant == {"7": 1}


def test_500_page_renders_even_when_the_menu_cannot(rf, world, monkeypatch):
    from django.contrib.auth.models import AnonymousUser
    from django.contrib.sessions.backends.db import SessionStore

    from gateway.portal import errors

    request = rf.get("/portal/usage/")
    request.user, request.session = world.users["owner"], SessionStore()
    page = errors.server_error(request)
    assert page.status_code == 500 and 'href="/portal/usage/"' in page.content.decode()

    def broken(request):
        raise RuntimeError("database is down")

    monkeypatch.setattr(errors, "context_processor", broken)
    request.user = AnonymousUser()
    page = errors.server_error(request)
    assert page.status_code == 500 and "Something went wrong" in page.content.decode()


def test_charts_fold_small_series_but_never_add_means():
    from datetime import UTC, datetime

    from gateway.portal.charts import MAX_SERIES, chart

    buckets = [datetime(2026, 12, 1, h, tzinfo=UTC) for h in range(2)]
    series = {f"key {i}": [float(i), 1.0] for i in range(12)}
    bars = chart("c", "Tokens", buckets, series)
    assert len(bars["datasets"]) == MAX_SERIES and bars["datasets"][-1]["label"] == "other"
    assert sum(d["total"] for d in bars["datasets"]) == sum(sum(v) for v in series.values())
    assert bars["integer"] and all(isinstance(v, int) for v in bars["datasets"][0]["data"])
    lines = chart("t", "TTFT", buckets, {k: [v[0], None] for k, v in series.items()},
                  kind="line", integer=False)
    assert "other" not in [d["label"] for d in lines["datasets"]]
    assert lines["datasets"][0]["data"][1] is None  # a gap stays a gap
    money = chart("s", "Spend", buckets, {"m": [Decimal("0.005"), Decimal("1234.5")]},
                  currency="USD")
    assert money["datasets"][0]["data"] == [0.01, 1234.5] and money["places"] == 2


def test_break_glass_read_page_shows_chat_as_text(client, settings):
    import base64

    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Permission

    from gateway.contentlog import breakglass, crypto, store

    settings.CONTENT_LOG_MASTER_KEYS = "k1:" + base64.b64encode(b"m" * 32).decode()
    crypto.reset_keys()
    try:
        tenant, now = make_tenant("acme"), timezone.now()
        chat = [{"role": "system", "content": "Be <brief>."},
                {"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]
        store.write_record(tenant.pk, "req-chat", chat, "General Kenobi", now=now)
        users = []
        for name, perm in (("reqr", "request_breakglass"), ("appr", "approve_breakglass")):
            user = get_user_model().objects.create_user(name, f"{name}@x.test", "pw",
                                                        is_staff=True)
            user.user_permissions.add(Permission.objects.get(codename=perm))
            users.append(get_user_model().objects.get(pk=user.pk))
        grant = breakglass.request_access(
            users[0], tenant, "Ticket 1: abuse report, reviewing the conversation in full.",
            now - timedelta(hours=1), now + timedelta(hours=1), timedelta(minutes=30))
        breakglass.approve(grant, users[1])
        client.force_login(users[0])
        page = client.post(f"/breakglass/{grant.pk}/read/").content.decode()
        assert '<div class="role">user</div><pre>Hello there</pre>' in page
        assert "Be &lt;brief&gt;." in page and "General Kenobi" in page
        assert "{&#x27;role&#x27;" not in page and "[{" not in page  # no Python repr
        assert 'id="header"' in page  # the admin's layout
    finally:
        crypto.reset_keys()
