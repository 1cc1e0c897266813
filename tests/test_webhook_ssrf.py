"""Spend-alert webhooks cannot be turned into a probe of the platform's own network.

https only; loopback, private, link-local, multicast and reserved addresses refused at creation
(API and portal) and again at delivery, on the address actually connected; DNS rebinding
(simulated by a resolver stub) cannot swap the address; no redirects; a fixed outcome
vocabulary; a cap per tenant; signed payloads; deliveries on their own queue with retries.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from metering.billing import alerts, tasks, webhooks
from metering.billing.models import AlertEvent, SpendAlert
from tenants.auth import clear_cache
from tests.worlds import build_world, record, roll_up, this_hour

PUBLIC = "93.184.216.34"


@pytest.fixture
def world(db, redis_client, settings):
    clear_cache()
    return build_world()


@pytest.fixture
def dns(monkeypatch) -> dict[str, list[str]]:
    """A resolver stub: host -> answers (one list per call, the last one repeating)."""
    answers: dict[str, list[str]] = {}
    calls: list[str] = []

    def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        if host not in answers:
            raise socket.gaierror("unknown host")
        queue = answers[host]
        return [queue.pop(0) if len(queue) > 1 else queue[0]]

    monkeypatch.setattr(webhooks, "resolver", resolve)
    answers["calls"] = calls  # type: ignore[assignment]
    return answers


class Receiver:
    """A real HTTP server on loopback that records what reaches it."""

    def __init__(self, status: int = 204, headers: dict[str, str] | None = None) -> None:
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.connections = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.requests.append((dict(self.headers), body))
                self.send_response(status)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        class Server(HTTPServer):
            def verify_request(self, request, client_address) -> bool:  # type: ignore[override]
                outer.connections += 1
                return True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


def _alert(world, url: str) -> SpendAlert:
    # Straight to the database, as an alert saved while its name still pointed somewhere public.
    return SpendAlert.objects.create(tenant=world.tenant, metric="tokens", period="month",
                                     threshold=Decimal(1), webhook_url=url)


def _fired(world, alert: SpendAlert) -> AlertEvent:
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", this_hour()))
    [event] = alerts.check_all(this_hour())
    assert event.alert_id == alert.pk and event.webhook_status == alerts.QUEUED
    return event


# --- addresses -----------------------------------------------------------------------------

@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.9.9.9", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
    "100.64.0.1", "0.0.0.0", "224.0.0.1", "239.255.255.250", "255.255.255.255", "240.0.0.1",
    "192.0.2.1", "::1", "::", "fe80::1", "fc00::1", "fd12:3456::1", "ff02::1",
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "2002:7f00:1::1",
    "64:ff9b::a9fe:a9fe", "::127.0.0.1", "2001:db8::1", "junk",
])
def test_non_public_addresses_are_refused(settings, address):
    settings.WEBHOOK_ALLOWED_CIDRS = []
    assert webhooks.address_allowed(address) is False


@pytest.mark.parametrize("address", [PUBLIC, "8.8.8.8", "2606:4700:4700::1111"])
def test_public_addresses_are_allowed(settings, address):
    settings.WEBHOOK_ALLOWED_CIDRS = []
    assert webhooks.address_allowed(address) is True


def test_an_operator_can_allow_a_private_network(settings):
    settings.WEBHOOK_ALLOWED_CIDRS = ["10.20.0.0/16"]
    assert webhooks.address_allowed("10.20.3.4") and not webhooks.address_allowed("10.21.0.1")


@pytest.mark.parametrize("url,reason", [
    ("http://hooks.example.com/x", "https"),
    ("ftp://hooks.example.com/x", "https"),
    ("file:///etc/passwd", "https"),
    ("https://user:pw@hooks.example.com/x", "user name"),
    ("https://hooks.example.com:22/x", "port"),
    ("https:///x", "no host"),
])
def test_url_rules(settings, url, reason):
    settings.WEBHOOK_ALLOW_HTTP = False
    with pytest.raises(webhooks.UnsafeWebhook, match=reason):
        webhooks.parse_url(url)


def test_http_only_with_the_development_setting(settings):
    settings.WEBHOOK_ALLOW_HTTP = True
    settings.WEBHOOK_ALLOWED_PORTS = [80, 443]
    assert webhooks.parse_url("http://hooks.example.com/x").port == 80


def test_one_private_answer_spoils_the_name(dns):
    dns["mixed.example.com"] = [PUBLIC]
    webhooks.check_url("https://mixed.example.com/")
    dns["mixed.example.com"] = ["10.0.0.1"]
    with pytest.raises(webhooks.UnsafeWebhook, match="not allowed"):
        webhooks.check_url("https://mixed.example.com/")


# --- creation: API and portal ----------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000/api/tenants/", "https://127.0.0.1/", "https://localhost/",
    "https://[::1]/", "https://169.254.169.254/latest/meta-data/", "https://10.0.0.8/",
    "https://[::ffff:127.0.0.1]/", "ftp://files.example.com/", "https://internal.example.com/",
])
def test_the_api_refuses_unsafe_webhooks(world, dns, url):
    dns["localhost"] = ["127.0.0.1"]
    dns["internal.example.com"] = ["192.168.10.5"]
    client = APIClient()
    client.force_login(world.users["owner"])
    response = client.post("/api/tenants/acme/alerts/", {
        "metric": "money", "period": "month", "threshold": "5", "webhook_url": url,
    }, format="json")
    assert response.status_code == 400, response.content
    assert "webhook_url" in response.content.decode()
    assert not SpendAlert.objects.exists()


def test_the_portal_refuses_unsafe_webhooks(client, world, dns):
    from tests.test_portal_views import signed_in

    dns["internal.example.com"] = ["10.1.1.1"]
    signed_in(client, world, "owner")
    response = client.post(reverse("portal:alerts"), {
        "metric": "money", "period": "month", "threshold": "50", "api_key": "",
        "webhook_url": "https://internal.example.com/hook"})
    assert response.status_code == 200 and "not allowed" in response.content.decode()
    assert not SpendAlert.objects.exists()


def test_the_signing_secret_is_shown_once(world, dns):
    dns["hooks.example.com"] = [PUBLIC]
    client = APIClient()
    client.force_login(world.users["owner"])
    created = client.post("/api/tenants/acme/alerts/", {
        "metric": "money", "period": "month", "threshold": "5",
        "webhook_url": "https://hooks.example.com/spend"}, format="json")
    assert created.status_code == 201, created.content
    secret = created.json()["webhook_secret"]
    assert secret.startswith("whsec_") and len(secret) > 40
    assert SpendAlert.objects.get().webhook_secret == secret
    again = client.get(f"/api/tenants/acme/alerts/{created.json()['id']}/").json()
    assert again["webhook_secret"] is None
    listing = client.get("/api/tenants/acme/alerts/").content.decode()
    assert secret not in listing


def test_alerts_per_tenant_are_capped(world, settings):
    settings.SPEND_ALERTS_MAX_PER_TENANT = 3
    client = APIClient()
    client.force_login(world.users["owner"])
    answers = [client.post("/api/tenants/acme/alerts/", {
        "metric": "tokens", "period": "day", "threshold": str(n + 1)}, format="json")
        for n in range(4)]
    assert [a.status_code for a in answers] == [201, 201, 201, 400]
    assert "at most 3" in answers[-1].content.decode()
    assert SpendAlert.objects.filter(tenant=world.tenant).count() == 3


@pytest.mark.django_db(transaction=True)
def test_racing_creations_cannot_pass_the_cap(redis_client, settings):
    """Ten threads race for the last two slots: the tenant row lock lets exactly two in."""
    from django.db import connection

    from tests.factories import make_tenant

    settings.SPEND_ALERTS_MAX_PER_TENANT = 5
    tenant = make_tenant("race")
    for n in range(3):
        alerts.create_alert(tenant, metric="tokens", threshold=Decimal(n + 1))
    barrier = threading.Barrier(10)
    results: list[str] = []

    def create(n: int) -> None:
        try:
            barrier.wait()
            alerts.create_alert(tenant, metric="tokens", threshold=Decimal(100 + n))
            results.append("ok")
        except alerts.TooManyAlerts:
            results.append("capped")
        finally:
            connection.close()

    threads = [threading.Thread(target=create, args=(n,)) for n in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == ["capped"] * 8 + ["ok"] * 2
    assert SpendAlert.objects.filter(tenant=tenant).count() == 5


# --- delivery --------------------------------------------------------------------------------

def test_a_loopback_server_is_never_reached(world, receiver, settings):
    """The alert was stored with a loopback URL (made before these rules, or by hand): the
    delivery refuses it and the server sees no connection at all."""
    settings.WEBHOOK_ALLOW_HTTP = True
    settings.WEBHOOK_ALLOWED_PORTS = [receiver.port]
    alert = _alert(world, f"http://127.0.0.1:{receiver.port}/hook")
    event = _fired(world, alert)
    outcome = alerts.deliver(event.pk)
    assert outcome is webhooks.BLOCKED
    assert receiver.connections == 0 and receiver.requests == []
    event.refresh_from_db()
    assert event.webhook_status == "blocked: address not allowed"


def test_dns_rebinding_cannot_swap_the_address(world, dns, receiver, settings, monkeypatch):
    """The name answered a public address when the alert was saved, and loopback at delivery
    (a rebinding attacker's DNS): the delivery resolves once, refuses, and connects nowhere."""
    settings.WEBHOOK_ALLOW_HTTP = True
    settings.WEBHOOK_ALLOWED_PORTS = [receiver.port]
    dns["rebind.example.com"] = [PUBLIC, "127.0.0.1"]
    url = f"http://rebind.example.com:{receiver.port}/hook"
    webhooks.check_url(url)  # creation-time check passes on the public answer
    connects: list[tuple[str, int]] = []
    real = socket.create_connection
    monkeypatch.setattr(webhooks, "_create_connection",
                        lambda addr, *a, **k: connects.append(addr) or real(addr, *a, **k))
    event = _fired(world, _alert(world, url))
    assert alerts.deliver(event.pk) is webhooks.BLOCKED
    assert connects == [] and receiver.connections == 0


def test_the_checked_address_is_the_one_connected(world, dns, settings, monkeypatch):
    """One resolution per attempt, and the socket goes to that IP: a second, different answer
    (what a rebinding resolver gives the HTTP library's own lookup) is never asked for."""
    dns["hooks.example.com"] = [PUBLIC, "127.0.0.1"]
    connects: list[tuple[str, int]] = []

    def refuse(addr, *args, **kwargs):
        connects.append(addr)
        raise ConnectionRefusedError("refused")

    monkeypatch.setattr(webhooks, "_create_connection", refuse)
    event = _fired(world, _alert(world, "https://hooks.example.com/hook"))
    assert alerts.deliver(event.pk) is webhooks.UNREACHABLE
    assert connects == [(PUBLIC, 443)]
    assert dns["calls"] == ["hooks.example.com"]  # type: ignore[comparison-overlap]


def test_the_connected_peer_is_checked_before_sending(world, receiver, settings, monkeypatch,
                                                      dns):
    """Even if the socket ends up at loopback (a route, a NAT), nothing is sent."""
    dns["hooks.example.com"] = [PUBLIC]
    settings.WEBHOOK_ALLOW_HTTP = True
    settings.WEBHOOK_ALLOWED_PORTS = [80]
    real = socket.create_connection
    monkeypatch.setattr(webhooks, "_create_connection",
                        lambda addr, *a, **k: real(("127.0.0.1", receiver.port), *a, **k))
    event = _fired(world, _alert(world, "http://hooks.example.com/hook"))
    assert alerts.deliver(event.pk) is webhooks.BLOCKED
    assert receiver.requests == []


@pytest.fixture
def local_allowed(settings, receiver):
    """The operator allows loopback (as for an internal alert router) so deliveries can land."""
    settings.WEBHOOK_ALLOW_HTTP = True
    settings.WEBHOOK_ALLOWED_CIDRS = ["127.0.0.1/32"]
    settings.WEBHOOK_ALLOWED_PORTS = [receiver.port]
    return receiver


def test_a_delivery_is_signed_with_the_alerts_secret(world, local_allowed):
    receiver = local_allowed
    alert = _alert(world, f"http://127.0.0.1:{receiver.port}/hook")
    event = _fired(world, alert)
    assert alerts.deliver(event.pk) is webhooks.DELIVERED
    [(headers, body)] = receiver.requests
    assert json.loads(body)["delivery"] == f"alert-event-{event.pk}"
    assert headers[webhooks.DELIVERY_HEADER] == f"alert-event-{event.pk}"
    signature = headers[webhooks.SIGNATURE_HEADER]
    assert webhooks.verify_signature(alert.webhook_secret, signature, body)
    assert not webhooks.verify_signature(alert.webhook_secret, signature, body + b" ")
    assert not webhooks.verify_signature("whsec_other", signature, body)
    stale = int(signature.split(",")[0][2:]) + 3600
    assert not webhooks.verify_signature(alert.webhook_secret, signature, body, now=stale)
    event.refresh_from_db()
    assert event.webhook_status == "delivered" and event.webhook_attempts == 1


@pytest.mark.parametrize("status,headers,expected", [
    (302, {"Location": "http://127.0.0.1:1/elsewhere"}, webhooks.REDIRECT),
    (401, {}, webhooks.CLIENT_ERROR),
    (503, {}, webhooks.SERVER_ERROR),
])
def test_outcomes_are_a_fixed_vocabulary_and_redirects_are_not_followed(
        world, settings, status, headers, expected):
    server = Receiver(status, headers)
    try:
        settings.WEBHOOK_ALLOW_HTTP = True
        settings.WEBHOOK_ALLOWED_CIDRS = ["127.0.0.1/32"]
        settings.WEBHOOK_ALLOWED_PORTS = [server.port, 1]
        event = _fired(world, _alert(world, f"http://127.0.0.1:{server.port}/hook"))
        assert alerts.deliver(event.pk) is expected
        assert len(server.requests) == 1  # one POST, no second request to the Location
    finally:
        server.close()


def test_a_dead_receiver_reads_unreachable_without_error_text(world, settings):
    settings.WEBHOOK_ALLOW_HTTP = True
    settings.WEBHOOK_ALLOWED_CIDRS = ["127.0.0.1/32"]
    settings.WEBHOOK_ALLOWED_PORTS = [9]
    event = _fired(world, _alert(world, "http://127.0.0.1:9/nothing"))
    assert alerts.deliver(event.pk) is webhooks.UNREACHABLE
    event.refresh_from_db()
    assert event.webhook_status == "unreachable"
    assert event.emailed == 2  # the email went out regardless, to the owner and billing


def test_retries_with_backoff_then_stop(world, settings):
    settings.WEBHOOK_ALLOW_HTTP = True
    settings.WEBHOOK_ALLOWED_CIDRS = ["127.0.0.1/32"]
    settings.WEBHOOK_ALLOWED_PORTS = [9]
    settings.WEBHOOK_MAX_ATTEMPTS = 3
    event = _fired(world, _alert(world, "http://127.0.0.1:9/nothing"))
    tasks.deliver_webhook.apply(args=[event.pk])  # eager: each retry runs at once
    event.refresh_from_db()
    assert event.webhook_attempts == 3 and event.webhook_status == "unreachable"
    settings.WEBHOOK_RETRY_BASE_SECONDS = 10
    assert 5 <= tasks.retry_delay(1) <= 10
    assert 40 <= tasks.retry_delay(4) <= 80


def test_a_final_outcome_is_not_retried(world, settings, dns):
    dns["internal.example.com"] = ["10.0.0.1"]
    settings.WEBHOOK_MAX_ATTEMPTS = 5
    event = _fired(world, _alert(world, "https://internal.example.com/"))
    tasks.deliver_webhook.apply(args=[event.pk])
    event.refresh_from_db()
    assert event.webhook_attempts == 1 and event.webhook_status.startswith("blocked")


def test_deliveries_have_their_own_queue():
    from gateway.celery import app

    route = app.amqp.router.route({}, "billing.deliver_webhook")
    assert route["queue"].name == "webhooks"
    assert app.amqp.router.route({}, "billing.check_spend_alerts")["queue"].name != "webhooks"


def test_firing_queues_the_delivery_after_commit(world, django_capture_on_commit_callbacks,
                                                 monkeypatch):
    queued: list[int] = []
    monkeypatch.setattr(tasks.deliver_webhook, "delay", lambda event_id: queued.append(event_id))
    alert = _alert(world, "https://hooks.example.com/")
    with django_capture_on_commit_callbacks(execute=True):
        event = _fired(world, alert)
    assert queued == [event.pk]


def test_the_secret_can_be_rotated_and_is_shown_once_more(world, dns, client):
    from tests.test_portal_views import signed_in

    dns["hooks.example.com"] = [PUBLIC]
    alert = _alert(world, "https://hooks.example.com/x")
    old = alert.webhook_secret
    api = APIClient()
    api.force_login(world.users["owner"])
    rotated = api.post(f"/api/tenants/acme/alerts/{alert.pk}/rotate-secret/").json()
    assert rotated["webhook_secret"] not in (None, old)
    assert SpendAlert.objects.get().webhook_secret == rotated["webhook_secret"]
    signed_in(client, world, "owner")
    page = client.post(reverse("portal:alert_rotate_secret", args=[alert.pk]), follow=True)
    newest = SpendAlert.objects.get().webhook_secret
    assert newest != rotated["webhook_secret"] and newest in page.content.decode()
    outsider = APIClient()
    outsider.force_login(world.users["outsider"])
    assert outsider.post(f"/api/tenants/acme/alerts/{alert.pk}/rotate-secret/").status_code in (
        403, 404)


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
def test_a_webhooks_worker_delivers_from_its_own_queue(redis_client):
    """Live: firing queues the delivery on `webhooks`; a worker consuming only that queue (as
    `manage.py serve` starts one) delivers it, signed."""
    import sys

    from tests import procs
    from tests.factories import make_key, make_tenant

    receiver = Receiver()
    env = {"WEBHOOK_ALLOW_HTTP": "true", "WEBHOOK_ALLOWED_CIDRS": "127.0.0.1/32",
           "WEBHOOK_ALLOWED_PORTS": str(receiver.port)}
    worker = procs.Proc("webhooks", [
        sys.executable, "-m", "celery", "-A", "gateway", "worker", "-Q", "webhooks", "-P",
        "threads", "-c", "2", "-n", "webhooks-test@%h", "--without-mingle", "--without-gossip",
        "-l", "info"], procs.child_env(env))
    try:
        tenant = make_tenant("live-hooks")
        key, _ = make_key(tenant)
        alert = SpendAlert.objects.create(tenant=tenant, metric="tokens", period="month",
                                          threshold=Decimal(1),
                                          webhook_url=f"http://127.0.0.1:{receiver.port}/h")
        roll_up(record(tenant, key, "sim-small", this_hour()))
        [event] = alerts.check_all(this_hour())  # autocommit: queued at once
        procs.wait_until(lambda: receiver.requests, 60, "the delivery", worker)
        [(headers, body)] = receiver.requests
        assert webhooks.verify_signature(alert.webhook_secret,
                                         headers[webhooks.SIGNATURE_HEADER], body)
        procs.wait_until(lambda: AlertEvent.objects.get(pk=event.pk).webhook_status
                         == "delivered", 10, "the outcome", worker)
    finally:
        worker.stop()
        receiver.close()


def test_a_trickling_receiver_cannot_hold_a_delivery(world, settings):
    """Headers one byte every 0.3 s: each read is within the timeout, the attempt is not."""
    import time as _time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    def trickle() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100:
            try:
                conn.send(bytes([byte]))
            except OSError:
                break
            _time.sleep(0.3)
        conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    settings.WEBHOOK_ALLOW_HTTP = True
    settings.WEBHOOK_ALLOWED_CIDRS = ["127.0.0.1/32"]
    settings.WEBHOOK_ALLOWED_PORTS = [port]
    settings.WEBHOOK_TIMEOUT_SECONDS = 0.5
    event = _fired(world, _alert(world, f"http://127.0.0.1:{port}/slow"))
    start = _time.monotonic()
    assert alerts.deliver(event.pk) is webhooks.UNREACHABLE
    assert _time.monotonic() - start < 2.0
    listener.close()
