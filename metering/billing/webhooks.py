"""Spend-alert webhooks: outbound HTTP to an address a tenant chose, without becoming a probe.

A webhook URL is tenant input that makes the platform open a connection, so it is checked
twice: when the alert is saved (API, portal, admin) and again on every delivery.

- ``https`` only; ``http`` only when ``WEBHOOK_ALLOW_HTTP`` is on (development).
- No user:password in the URL, no ports other than ``WEBHOOK_ALLOWED_PORTS``.
- Every address the host name resolves to must be public: loopback, private, link-local,
  shared (CGNAT), multicast, reserved and unspecified addresses are refused, in IPv4 and IPv6,
  including IPv4 wrapped in IPv6 (``::ffff:127.0.0.1``, 6to4, Teredo, NAT64). An operator can
  allow chosen networks with ``WEBHOOK_ALLOWED_CIDRS`` (an internal alert router).
- DNS rebinding: the name is resolved **once** per delivery, the addresses are checked, and
  the connection goes to the checked IP (the Host header and TLS SNI/certificate check still
  use the name). The connected peer is checked again before anything is sent.
- Redirects are never followed; a 3xx is an outcome like any other.

The tenant sees a fixed vocabulary (``Outcome``), never an exception's text, so the outcome is
not a port scanner: "unreachable" covers refused, reset, timed out and TLS failures alike.

Each delivery is signed as Stripe and GitHub do: ``X-Gateway-Signature: t=<unix>,v1=<hex>``,
where ``v1 = HMAC-SHA256(alert secret, "<t>." + body)``; receivers check the MAC and reject a
``t`` older than a few minutes (``verify_signature``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import http.client
import ipaddress
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

from django.conf import settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Sequence[str]]

SIGNATURE_HEADER = "X-Gateway-Signature"
DELIVERY_HEADER = "X-Gateway-Delivery"
SECRET_PREFIX = "whsec_"
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT: not globally reachable


class UnsafeWebhook(ValueError):
    """The URL or an address it leads to may not be called; the message is safe to show."""


# --- outcomes --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """What the tenant is told. ``final``: no retry can change it."""

    status: str
    final: bool

    @property
    def delivered(self) -> bool:
        return self.status == DELIVERED.status


DELIVERED = Outcome("delivered", True)
BLOCKED = Outcome("blocked: address not allowed", True)
UNREACHABLE = Outcome("unreachable", False)
REDIRECT = Outcome("rejected: HTTP 3xx (redirects are not followed)", True)
CLIENT_ERROR = Outcome("rejected: HTTP 4xx", True)
SERVER_ERROR = Outcome("failed: HTTP 5xx", False)
TOO_MANY = Outcome("rejected: HTTP 429", False)  # the receiver asks us to come back later


def outcome_of_status(code: int) -> Outcome:
    if 200 <= code < 300:
        return DELIVERED
    if 300 <= code < 400:
        return REDIRECT
    if code == 429:
        return TOO_MANY
    if 400 <= code < 500:
        return CLIENT_ERROR
    return SERVER_ERROR


# --- addresses -------------------------------------------------------------------------------

@lru_cache(maxsize=8)
def _allowed_networks(cidrs: tuple[str, ...]) -> tuple[ipaddress.IPv4Network |
                                                        ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, Teredo client, NAT64), if any."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped:
        return address.ipv4_mapped
    if address.sixtofour:
        return address.sixtofour
    if address.teredo:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _public(address: IPAddress) -> bool:
    return not (
        address.is_private or address.is_loopback or address.is_link_local
        or address.is_multicast or address.is_reserved or address.is_unspecified
        or not address.is_global or address in _SHARED
    )


def address_allowed(value: str) -> bool:
    """May a webhook connect to this IP? Public unicast only, unless the operator allowed it."""
    try:
        address: IPAddress = ipaddress.ip_address(value.split("%", 1)[0])
    except ValueError:
        return False
    allowed = _allowed_networks(tuple(settings.WEBHOOK_ALLOWED_CIDRS))
    inner = _embedded_ipv4(address)
    if any(address in net for net in allowed) or (inner and any(inner in n for n in allowed)):
        return True
    return _public(address) and (inner is None or _public(inner))


# --- URLs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    scheme: str
    host: str  # as written (IDNA-encoded), for Host and SNI
    port: int
    path: str  # path + query


def parse_url(url: str) -> Target:
    """Scheme, credentials, host and port rules; raises UnsafeWebhook with a reason to show."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        raise UnsafeWebhook("Not a valid URL.") from None
    schemes = ("https", "http") if settings.WEBHOOK_ALLOW_HTTP else ("https",)
    if parts.scheme.lower() not in schemes:
        raise UnsafeWebhook("Webhook URLs must use https.")
    if parts.username is not None or parts.password is not None:
        raise UnsafeWebhook("Webhook URLs may not contain a user name or password.")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise UnsafeWebhook("The webhook URL has no host.")
    scheme = parts.scheme.lower()
    port = port or (443 if scheme == "https" else 80)
    if port not in settings.WEBHOOK_ALLOWED_PORTS:
        raise UnsafeWebhook(f"Webhook URLs may use port {_ports()} only.")
    try:
        host = host.encode("idna").decode("ascii")
    except UnicodeError:
        raise UnsafeWebhook("The webhook host name is not valid.") from None
    path = parts.path or "/"
    return Target(scheme, host, port, path + (f"?{parts.query}" if parts.query else ""))


def _ports() -> str:
    return " or ".join(str(p) for p in settings.WEBHOOK_ALLOWED_PORTS)


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


# The real resolver. Tests swap in their own to simulate DNS rebinding (answers that change).
resolver: Resolver = system_resolver


def resolve_checked(target: Target) -> str:
    """Resolve once; every answer must be allowed (one bad record spoils the name). Returns the
    address to connect to."""
    try:
        literal = ipaddress.ip_address(target.host.strip("[]"))
        addresses = [str(literal)]
    except ValueError:
        try:
            addresses = list(resolver(target.host, target.port))
        except (OSError, UnicodeError):
            raise UnsafeWebhook("The webhook host name does not resolve.") from None
    if not addresses:
        raise UnsafeWebhook("The webhook host name does not resolve.")
    if not all(address_allowed(a) for a in addresses):
        raise UnsafeWebhook("The webhook host resolves to an address that is not allowed "
                            "(loopback, private, link-local, multicast or reserved).")
    return addresses[0]


def check_url(url: str) -> str:
    """The creation-time check (API, portal, admin): syntax and today's DNS answer."""
    resolve_checked(parse_url(url))
    return url


# --- delivery --------------------------------------------------------------------------------

class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to a checked IP; the Host header stays the URL's name."""

    def __init__(self, host: str, port: int, *, ip: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._ip = ip

    def connect(self) -> None:
        self.sock = _connect_checked(self._ip, self.port, self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """TLS to a checked IP, with SNI and certificate verification against the URL's name."""

    def __init__(self, host: str, port: int, *, ip: str, timeout: float) -> None:
        tls = ssl.create_default_context()
        super().__init__(host, port, timeout=timeout, context=tls)
        self._tls = tls
        self._ip = ip

    def connect(self) -> None:
        raw = _connect_checked(self._ip, self.port, self.timeout)
        self.sock = self._tls.wrap_socket(raw, server_hostname=self.host)


_create_connection = socket.create_connection  # the one way out (tests watch it)


def _connect_checked(ip: str, port: int, timeout: float | None) -> socket.socket:
    sock = _create_connection((ip, port), timeout=timeout)
    peer = sock.getpeername()[0]
    if not address_allowed(str(peer)):  # the address actually connected, not the one asked for
        sock.close()
        raise UnsafeWebhook("connected peer not allowed")
    return sock


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def signature(secret: str, body: bytes, timestamp: int) -> str:
    mac = hmac.new(secret.encode(), b"%d." % timestamp + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify_signature(secret: str, header: str, body: bytes, *, tolerance_s: int = 300,
                     now: float | None = None) -> bool:
    """What a receiver does: the MAC matches and the timestamp is recent (no replays)."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    try:
        timestamp = int(fields.get("t", ""))
    except ValueError:
        return False
    if abs((now if now is not None else time.time()) - timestamp) > tolerance_s:
        return False
    expected = signature(secret, body, timestamp).rsplit("v1=", 1)[1]
    return hmac.compare_digest(expected, fields.get("v1", ""))


def post(url: str, body: bytes, *, secret: str, delivery_id: str) -> Outcome:
    """One attempt: check, resolve once, connect to the checked IP, POST, read the status."""
    try:
        target = parse_url(url)
        ip = resolve_checked(target)
    except UnsafeWebhook:
        return BLOCKED
    cls = _PinnedHTTPSConnection if target.scheme == "https" else _PinnedHTTPConnection
    conn = cls(target.host, target.port, ip=ip, timeout=settings.WEBHOOK_TIMEOUT_SECONDS)
    headers = {
        "Content-Type": "application/json", "User-Agent": "inference-gateway-webhook/1",
        SIGNATURE_HEADER: signature(secret, body, int(time.time())),
        DELIVERY_HEADER: delivery_id,
    }
    # The socket timeout bounds each read; this bounds the whole attempt, so a receiver that
    # trickles its headers a byte at a time cannot hold a delivery thread.
    watchdog = threading.Timer(settings.WEBHOOK_TIMEOUT_SECONDS * 2, _cut, args=(conn,))
    watchdog.start()
    try:
        conn.request("POST", target.path, body=body, headers=headers)
        response = conn.getresponse()  # status and headers only; a Location is never followed
        return outcome_of_status(response.status)
    except UnsafeWebhook:
        return BLOCKED
    except (OSError, http.client.HTTPException, ssl.SSLError):
        return UNREACHABLE
    finally:
        watchdog.cancel()
        conn.close()


def _cut(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked read, which then fails
