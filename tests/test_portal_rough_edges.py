"""The rough edges of the third product walk (issue 31), each pinned: errors said once and
plainly, custom usage ranges with a comparison, members exporting their own usage, a statement
file that names its tenant and date, no technical 404 in the quick start, docs that fetch no
logo from a CDN, admin lists that fit a 1366 px screen, live pool status, alert emails that
link the portal, and the quick start's first curl line on the port it serves."""

from __future__ import annotations

import csv
import io
import re
import subprocess
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.core import mail
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from openpyxl import load_workbook

from gateway.api.offline_docs import REDOC_LOGO, redoc_bundle_text
from metering.billing import alerts
from metering.billing.models import SpendAlert
from tenants.auth import clear_cache
from tests.worlds import build_world, price, record, roll_up, this_hour

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def world(redis_client, settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    clear_cache()
    return build_world()


def as_user(world, who: str) -> Client:
    client = Client()
    client.force_login(world.users[who])
    return client


def test_a_range_error_is_said_once_and_a_future_range_is_refused(world):
    owner = as_user(world, "owner")
    now = timezone.now()
    fmt = "%Y-%m-%dT%H:%M"
    backwards = owner.post(reverse("portal:reports"), {
        "start": now.strftime(fmt), "end": (now - timedelta(days=1)).strftime(fmt),
        "format": "csv"}).content.decode()
    assert backwards.count("The end must come after the start.") == 1
    future = owner.post(reverse("portal:reports"), {
        "start": (now + timedelta(days=2)).strftime(fmt),
        "end": (now + timedelta(days=3)).strftime(fmt), "format": "csv"})
    assert future.status_code == 200 and "starts in the future" in future.content.decode()


def test_an_invalid_month_is_said_to_be_invalid(world):
    answer = as_user(world, "owner").get(reverse("portal:statement") + "?month=2026-13")
    assert answer.status_code == 400 and "is not a month" in answer.content.decode()
    assert as_user(world, "owner").get(reverse("portal:statement") + "?month=junk").status_code \
        == 400
    assert as_user(world, "owner").get(reverse("portal:statement")).status_code == 200


def test_api_usage_refuses_start_after_end(world):
    api = as_user(world, "owner")
    answer = api.get("/api/tenants/acme/usage/?start=2026-02-01&end=2026-01-01")
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "end"
    assert api.get("/api/tenants/acme/usage/?start=2026-01-01&end=2026-02-01").status_code == 200


def test_the_statement_xlsx_names_the_tenant_and_the_issue_date(world):
    hour = this_hour()
    price("sim-small", hour - timedelta(days=40), "1", "0", "2")
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", hour - timedelta(hours=1)))
    month = f"{hour - timedelta(hours=1):%Y-%m}"
    answer = as_user(world, "billing").get(
        reverse("portal:statement") + f"?month={month}&format=xlsx")
    book = load_workbook(io.BytesIO(answer.content))
    title = book.active.cell(1, 1).value
    assert title.startswith(f"Statement for Acme, {month}, issued {timezone.now():%Y-%m-%d}")
    assert book.active.title == "statement" and book.properties.title == title


def test_custom_dates_compare_with_the_period_before(world):
    hour = this_hour()
    day = hour.date() - timedelta(days=1)
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", hour - timedelta(days=1),
                   prompt=300),
            record(world.tenant, world.keys["owner"], "sim-small", hour - timedelta(days=2),
                   prompt=100),
            record(world.tenant, world.keys["owner"], "sim-small", hour - timedelta(days=2),
                   prompt=100))
    owner = as_user(world, "owner")
    page = owner.get(reverse("portal:usage") + f"?from={day}&to={day}").content.decode()
    assert f'value="{day}"' in page and "Custom dates" in page
    tiles = page[page.index('id="range-totals"'):page.index("</section>",
                                                           page.index('id="range-totals"'))]
    assert "▼ 50% vs previous" in tiles  # 1 request against 2 the day before
    bad = owner.get(reverse("portal:usage") + f"?from={day}&to={day - timedelta(days=3)}")
    body = bad.content.decode()
    assert body.count("The last day comes before the first.") == 1


def test_members_export_their_own_usage(world):
    hour = this_hour() - timedelta(hours=1)
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", hour, prompt=111),
            record(world.tenant, world.keys["member"], "sim-small", hour, prompt=222))
    url = reverse("portal:usage") + "?range=7d&format=csv"

    def keys_in(who: str) -> set[str]:
        answer = as_user(world, who).get(url)
        assert answer.status_code == 200 and answer["Content-Type"].startswith("text/csv")
        text = b"".join(answer.streaming_content).decode("utf-8-sig")
        return {row["key"].split(" (")[0] for row in csv.DictReader(io.StringIO(text))
                if row["key"] and row["key"] != "TOTAL"}

    assert keys_in("member") == {"member key"}
    assert keys_in("owner") == {"owner key", "member key"}
    assert keys_in("billing") == {"owner key", "member key"}
    outsider = b"".join(as_user(world, "outsider").get(url).streaming_content).decode()
    assert "owner key" not in outsider and "member key" not in outsider
    assert as_user(world, "staff").get(url).status_code == 302  # no tenant: no_tenant page


def test_no_technical_404_page_with_debug_on(world, settings):
    settings.DEBUG = True
    client = as_user(world, "owner")
    missing = client.get("/no/such/page/")
    assert missing.status_code == 404 and "DEBUG = True" not in missing.content.decode()
    assert "Page not found" in missing.content.decode()
    raised = client.get("/portal/keys/999999/revoke/")  # Http404 from a view
    assert raised.status_code == 404 and "DEBUG = True" not in raised.content.decode()
    assert client.get("/portal/keys")["Location"] == "/portal/keys/"  # APPEND_SLASH still works


def test_redoc_loads_no_logo_from_a_cdn(world):
    assert REDOC_LOGO.encode() not in redoc_bundle_text()
    page = Client().get(reverse("api:redoc")).content.decode()
    assert reverse("api:redoc_bundle") in page and "cdn" not in page.lower()
    bundle = Client().get(reverse("api:redoc_bundle"))
    assert bundle.status_code == 200 and b"Redoc" in bundle.content


def test_admin_lists_fit_a_laptop_screen(world):
    admin = as_user(world, "admin")
    tenant = admin.get(reverse("admin:tenants_tenant_change", args=[world.tenant.pk]))
    assert world.keys["owner"].key_hash not in tenant.content.decode()
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", this_hour()))
    usage = admin.get(reverse("admin:metering_usagerecord_changelist")).content.decode()
    header = usage[usage.index('<thead>'):usage.index('</thead>')]
    assert header.count("<th") <= 9  # the action checkbox and eight columns


def test_pool_status_refreshes_without_a_reload(world):
    url = reverse("admin:catalog_pool_live", args=[world.pool.pk])
    page = as_user(world, "admin").get(
        reverse("admin:catalog_pool_change", args=[world.pool.pk])).content.decode()
    assert f'data-url="{url}"' in page and "workers/pool_live.js" in page
    live = as_user(world, "admin").get(url)
    assert live.status_code == 200 and "Workers alive" in live.content.decode()
    assert as_user(world, "staff").get(url).status_code == 403
    for who in ("owner", "member", "billing", "outsider"):  # not staff: the admin sign-in
        assert as_user(world, who).get(url).status_code == 302


def test_the_alert_email_links_the_portal(world, settings):
    settings.PUBLIC_BASE_URL = "https://gw.example.test"
    now = this_hour()
    price("sim-small", now - timedelta(days=1), "1000", "0", "0")
    SpendAlert.objects.create(tenant=world.tenant, metric="money", period="month",
                              threshold=Decimal("0.01"), currency="USD")
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", now, prompt=2000))
    alerts.check_all(now)
    assert "https://gw.example.test/portal/usage/" in mail.outbox[0].body


@pytest.mark.integration
@pytest.mark.parametrize("args,url", [
    ([], "http://127.0.0.1:8000"), (["--port", "9001"], "http://127.0.0.1:9001"),
    (["--no-beat", "--port=9002", "--host", "0.0.0.0"], "http://127.0.0.1:9002"),
])
def test_the_quick_start_prints_the_port_it_serves(args, url):
    done = subprocess.run(["scripts/base_url.sh", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=10, check=True)
    assert done.stdout.strip() == url
    assert 'base_url.sh "$@"' in (ROOT / "scripts/run.sh").read_text()


def test_times_carry_their_zone(world):
    pending = as_user(world, "owner")
    pending.post(reverse("portal:members"), {"email": "tz@example.test", "role": "member"})
    page = pending.get(reverse("portal:members")).content.decode()
    row = page[page.index('data-email="tz@example.test"'):]
    assert re.search(r"<time datetime=\"[^\"]+Z\"[^>]*>[^<]+ UTC</time>", row[:row.index("</tr>")])
