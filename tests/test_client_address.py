"""The client address is decided in one place (infra.clientaddr): forwarded headers are
believed only from TRUSTED_PROXY_CIDRS, and uvicorn no longer rewrites scope["client"]."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from django.http import HttpResponse
from django.test import RequestFactory

from infra import clientaddr
from tenants.models import ClientCertificate
from tests import procs
from tests.factories import make_tenant
from tests.test_mtls import self_signed


def _scope(peer: str | None, **headers: str) -> dict:
    return {"client": (peer, 5555) if peer else None,
            "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


@pytest.fixture
def proxies(settings):
    settings.TRUSTED_PROXY_CIDRS = ["10.0.0.0/8", "fd00::/64"]


def test_forwarded_headers_from_anyone_else_are_ignored(proxies):
    scope = _scope("198.51.100.4", x_forwarded_for="10.0.0.9, 127.0.0.1")
    assert clientaddr.client_address(scope) == "198.51.100.4"


def test_forwarded_for_from_a_trusted_proxy_names_the_client(proxies):
    scope = _scope("10.0.0.2", x_forwarded_for="203.0.113.7")
    assert clientaddr.client_address(scope) == "203.0.113.7"


def test_a_client_cannot_prepend_its_way_in(proxies):
    """What the client wrote is left of the first untrusted hop: it proves nothing."""
    scope = _scope("10.0.0.2", x_forwarded_for="127.0.0.1, 10.0.0.5, 203.0.113.7, 10.0.0.3")
    assert clientaddr.client_address(scope) == "203.0.113.7"


def test_a_clients_forwarded_header_does_not_override_the_proxys(proxies):
    """Review 3, N6: the proxy writes X-Forwarded-For and passes the client's ``Forwarded``
    through; only the header the deployment names counts."""
    scope = _scope("10.0.0.2", forwarded="for=127.0.0.1", x_forwarded_for="203.0.113.7")
    assert clientaddr.client_address(scope) == "203.0.113.7"
    assert not clientaddr.is_local(scope)
    assert clientaddr.client_address(_scope("10.0.0.2", forwarded="for=127.0.0.1")) == "10.0.0.2"


def test_rfc7239_forwarded_when_the_proxy_writes_it(proxies, settings):
    settings.TRUSTED_PROXY_HEADER = "forwarded"
    scope = _scope("10.0.0.2", forwarded='for=127.0.0.1, for="[2001:db8::7]:443";proto=https, '
                   'for=10.0.0.4', x_forwarded_for="198.51.100.1")
    assert clientaddr.client_address(scope) == "2001:db8::7"  # rightmost untrusted hop


def test_x_real_ip_when_the_proxy_writes_it(proxies, settings):
    settings.TRUSTED_PROXY_HEADER = "x-real-ip"
    scope = _scope("10.0.0.2", x_real_ip="203.0.113.8", x_forwarded_for="127.0.0.1",
                   forwarded="for=127.0.0.1")
    assert clientaddr.client_address(scope) == "203.0.113.8"
    assert clientaddr.client_address(_scope("198.51.100.4", x_real_ip="127.0.0.1")) == \
        "198.51.100.4"


@pytest.mark.django_db
def test_a_clients_forwarded_header_neither_escapes_nor_aims_the_signin_lockout(proxies,
                                                                               settings):
    """12 wrong passwords with a fresh ``Forwarded: for=`` each were never locked out, and one
    could lock out a chosen victim's address; now the proxy's X-Forwarded-For decides."""
    from django.test import Client

    from tests.worlds import PASSWORD, make_user

    settings.AXES_FAILURE_LIMIT = 3
    make_user("owner")

    def attempt(password: str, client_ip: str, forged: str) -> int:
        return Client(REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR=client_ip,
                      HTTP_FORWARDED=f"for={forged}").post(
            "/portal/login/", {"username": "owner", "password": password}).status_code

    statuses = [attempt("wrong", "203.0.113.7", f"198.51.100.{i}") for i in range(5)]
    assert statuses[-1] == 429  # the attacker's own address is locked
    assert attempt(PASSWORD, "203.0.113.7", "198.51.100.99") == 429
    # The victim's address, named in the attacker's Forwarded headers, still signs in.
    assert attempt(PASSWORD, "203.0.113.50", "203.0.113.7") == 302


@pytest.mark.django_db
def test_the_audit_row_records_the_proxys_client_not_the_clients_claim(proxies):
    from rest_framework.test import APIClient

    from tenants.models import ContentLoggingChange
    from tests.worlds import build_world

    world = build_world()
    client = APIClient(REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="203.0.113.7",
                       HTTP_FORWARDED="for=192.0.2.66")
    client.force_login(world.users["owner"])
    assert client.put("/api/tenants/acme/content-logging/set/", {"enabled": True},
                      format="json").status_code == 200
    assert ContentLoggingChange.objects.get(tenant=world.tenant).remote_addr == "203.0.113.7"


def test_garbage_stops_at_the_last_address_vouched_for(proxies):
    scope = _scope("10.0.0.2", x_forwarded_for="203.0.113.7, unknown")
    assert clientaddr.client_address(scope) == "10.0.0.2"


def test_unix_socket_and_mapped_addresses(proxies):
    assert clientaddr.is_local(_scope(None))
    assert clientaddr.is_trusted_proxy("::ffff:10.1.2.3")
    assert not clientaddr.is_trusted_proxy("junk")


def test_loopback_spoofing_through_forwarded_for(settings):
    """From loopback, X-Forwarded-For names nobody unless loopback is a trusted proxy."""
    settings.TRUSTED_PROXY_CIDRS = []
    assert clientaddr.is_local(_scope("127.0.0.1", x_forwarded_for="203.0.113.9"))
    assert not clientaddr.is_local(_scope("203.0.113.9", x_forwarded_for="127.0.0.1"))
    settings.TRUSTED_PROXY_CIDRS = ["127.0.0.1/32"]  # a local reverse proxy
    assert not clientaddr.is_local(_scope("127.0.0.1", x_forwarded_for="203.0.113.9"))


def test_django_sees_the_decided_address_and_no_forged_proto(proxies, settings):
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    seen = {}

    def view(request):
        seen["addr"], seen["secure"] = request.META["REMOTE_ADDR"], request.is_secure()
        return HttpResponse()

    middleware = clientaddr.RealClientMiddleware(view)
    factory = RequestFactory()
    middleware(factory.get("/", REMOTE_ADDR="198.51.100.4", HTTP_X_FORWARDED_FOR="10.0.0.1",
                           HTTP_X_FORWARDED_PROTO="https"))
    assert seen == {"addr": "198.51.100.4", "secure": False}
    middleware(factory.get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="203.0.113.7",
                           HTTP_X_FORWARDED_PROTO="https"))
    assert seen == {"addr": "203.0.113.7", "secure": True}


# --- live: uvicorn must not rewrite scope["client"] ------------------------------------------

@pytest.fixture
def gateway(request, redis_client) -> Iterator[str]:
    server, url = procs.start_uvicorn(env={"TRUSTED_PROXY_CIDRS": request.param,
                                           "METRICS_TOKEN": ""})
    try:
        procs.wait_for_http(url + "/healthz", server)
        yield url
    finally:
        server.stop()


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("gateway", ["10.0.0.0/8"], indirect=True)
def test_a_forged_forwarded_for_cannot_borrow_a_trusted_proxys_certificate_check(gateway):
    """From loopback (not a proxy), a client claims to be the proxy 10.0.0.7 and sends a bound
    certificate's fingerprint. uvicorn used to take the claim as the peer."""
    _, fingerprint = self_signed()
    ClientCertificate.objects.create(tenant=make_tenant("acme"), name="job",
                                     fingerprint_sha256=fingerprint)
    answer = httpx.get(gateway + "/v1/models", headers={
        "X-Forwarded-For": "10.0.0.7", "X-SSL-Client-Fingerprint": fingerprint})
    assert answer.status_code == 401, answer.text
    # /metrics: the forged header does not make a loopback client remote either.
    assert httpx.get(gateway + "/metrics", headers={"X-Forwarded-For": "203.0.113.9"}
                     ).status_code == 200


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("gateway", ["127.0.0.1/32"], indirect=True)
def test_behind_a_local_proxy_metrics_follow_the_real_client(gateway):
    """With a reverse proxy on this host, 'loopback' is the proxy: the forwarded client decides."""
    assert httpx.get(gateway + "/metrics").status_code == 200
    remote = httpx.get(gateway + "/metrics", headers={"X-Forwarded-For": "203.0.113.9"})
    assert remote.status_code == 403
    # A client's own Forwarded header, passed through by the proxy, does not make it local.
    forged = httpx.get(gateway + "/metrics", headers={"X-Forwarded-For": "203.0.113.9",
                                                      "Forwarded": "for=127.0.0.1"})
    assert forged.status_code == 403
    _, fingerprint = self_signed()
    ClientCertificate.objects.create(tenant=make_tenant("acme"), name="job",
                                     fingerprint_sha256=fingerprint)
    via_proxy = httpx.get(gateway + "/v1/models", headers={
        "X-Forwarded-For": "203.0.113.9", "X-SSL-Client-Fingerprint": fingerprint})
    assert via_proxy.status_code == 200, via_proxy.text
