"""Spend alerts fire once per period, email the owners, call the webhook, and cap if asked."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from django.core import mail

from metering.billing import alerts
from metering.billing.models import AlertEvent, SpendAlert
from tenants.auth import authenticate, clear_cache
from tenants.models import ApiKey, Tenant
from tests.factories import bearer
from tests.worlds import build_world, price, record, roll_up, this_hour

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(redis_client):
    clear_cache()
    return build_world()


def _use(world, key, when, prompt=1000, completion=500):
    roll_up(record(world.tenant, key, "sim-small", when, prompt=prompt, completion=completion))


def test_fires_once_per_period_and_again_next_period(world):
    now = this_hour().replace(day=15, hour=12) if this_hour().day != 15 else this_hour()
    alert = SpendAlert.objects.create(tenant=world.tenant, metric="tokens", period="day",
                                      threshold=Decimal(2000))
    _use(world, world.keys["owner"], now - timedelta(minutes=30))
    assert alerts.check_all(now) == []  # 1,500 tokens: under
    _use(world, world.keys["member"], now - timedelta(minutes=20))
    fired = alerts.check_all(now)
    assert [e.value for e in fired] == [Decimal(3000)]
    # Owners and billing members hear about spend (issue 27).
    assert len(mail.outbox) == 1
    assert sorted(mail.outbox[0].to) == ["billing@example.test", "owner@example.test"]
    _use(world, world.keys["owner"], now - timedelta(minutes=10))
    assert alerts.check_all(now) == [] and alerts.check_all(now + timedelta(hours=1)) == []
    assert len(mail.outbox) == 1
    tomorrow = now + timedelta(days=1)
    _use(world, world.keys["owner"], tomorrow, prompt=2500)
    assert len(alerts.check_all(tomorrow)) == 1
    assert list(AlertEvent.objects.filter(alert=alert).values_list("period", flat=True)) == [
        f"{tomorrow:%Y-%m-%d}", f"{now:%Y-%m-%d}"]
    assert len(mail.outbox) == 2


def test_two_checkers_racing_notify_once(world):
    """Both read the alert as not fired; only the conditional UPDATE's winner notifies."""
    now = this_hour()
    alert = SpendAlert.objects.create(tenant=world.tenant, metric="tokens", period="month",
                                      threshold=Decimal(10))
    _use(world, world.keys["owner"], now)
    stale_a, stale_b = (SpendAlert.objects.get(pk=alert.pk) for _ in range(2))
    results = [alerts.check(stale_a, now), alerts.check(stale_b, now)]
    assert sum(r is not None for r in results) == 1
    assert AlertEvent.objects.filter(alert=alert).count() == 1 and len(mail.outbox) == 1


def test_money_alert_per_key_with_hard_cap_suspends_only_that_key(world):
    now = this_hour()
    price("sim-small", now - timedelta(days=40), "1000", "100", "2000")  # per million tokens
    key = world.keys["member"]
    SpendAlert.objects.create(tenant=world.tenant, api_key=key, metric="money", period="month",
                              threshold=Decimal("1.5"), hard_cap=True)
    _use(world, world.keys["owner"], now, prompt=10_000)  # another key's spend does not count
    assert alerts.check_all(now) == []
    authenticate(bearer(world.plaintexts["member"]))
    _use(world, key, now, prompt=1000, completion=500)  # 1.00 + 1.00 = 2.00 > 1.5
    [event] = alerts.check_all(now)
    assert event.value == Decimal(2) and event.suspended
    # Over budget, not expired: the key still authenticates (so callers get 429
    # insufficient_quota, not 401), its expiry is untouched, and it reads "over budget".
    capped = ApiKey.objects.get(pk=key.pk)
    assert capped.expires_at is None and capped.state() == "over budget"
    assert authenticate(bearer(world.plaintexts["member"])).over_budget
    assert not authenticate(bearer(world.plaintexts["owner"])).over_budget
    assert "over budget" in mail.outbox[0].body and "insufficient_quota" in mail.outbox[0].body
    assert "billing@example.test" in mail.outbox[0].to
    assert capped.resume() and capped.state() == "active"
    assert not authenticate(bearer(world.plaintexts["member"])).over_budget


def test_tenant_wide_hard_cap_suspends_the_tenant(world):
    now = this_hour()
    SpendAlert.objects.create(tenant=world.tenant, metric="tokens", period="day",
                              threshold=Decimal(100), hard_cap=True)
    _use(world, world.keys["owner"], now)
    [event] = alerts.check_all(now)
    assert event.suspended
    assert Tenant.objects.get(pk=world.tenant.pk).status == Tenant.Status.SUSPENDED
    assert Tenant.objects.get(pk=world.other.pk).status == Tenant.Status.ACTIVE


def test_webhook_gets_one_post(world, settings, django_capture_on_commit_callbacks, monkeypatch):
    """Firing twice in a period queues one delivery; it lands once (run inline here)."""
    from metering.billing import tasks

    monkeypatch.setattr(tasks.deliver_webhook, "delay",
                        lambda event_id: tasks.deliver_webhook.apply(args=[event_id]))
    received = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    # Loopback is refused unless the operator allows it (tests/test_webhook_ssrf.py).
    settings.WEBHOOK_ALLOW_HTTP = True
    settings.WEBHOOK_ALLOWED_CIDRS = ["127.0.0.1/32"]
    settings.WEBHOOK_ALLOWED_PORTS = [server.server_port]
    try:
        now = this_hour()
        SpendAlert.objects.create(
            tenant=world.tenant, metric="tokens", period="month", threshold=Decimal(1),
            webhook_url=f"http://127.0.0.1:{server.server_port}/hook",
        )
        _use(world, world.keys["owner"], now)
        with django_capture_on_commit_callbacks(execute=True):
            [event] = alerts.check_all(now)
            alerts.check_all(now)
    finally:
        server.shutdown()
    event.refresh_from_db()
    assert event.webhook_status == "delivered"
    assert len(received) == 1 and received[0]["tenant"] == "acme"
    assert received[0]["value"] == "1500"


def test_dead_webhook_does_not_stop_the_email(world, settings):
    settings.WEBHOOK_ALLOW_HTTP = True
    settings.WEBHOOK_ALLOWED_CIDRS = ["127.0.0.1/32"]
    settings.WEBHOOK_ALLOWED_PORTS = [9]
    now = this_hour()
    SpendAlert.objects.create(tenant=world.tenant, metric="tokens", period="month",
                              threshold=Decimal(1), webhook_url="http://127.0.0.1:9/nothing")
    _use(world, world.keys["owner"], now)
    [event] = alerts.check_all(now)
    assert event.emailed == 2  # the owner and the billing member
    assert alerts.deliver(event.pk).status == "unreachable"
