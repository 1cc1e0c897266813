"""Who is calling: the one place that decides a request's client address.

uvicorn runs with ``--no-proxy-headers`` (``manage.py serve``, ``tests/procs.py``), so
``scope["client"]`` is always the TCP peer. A peer in ``TRUSTED_PROXY_CIDRS`` is a proxy we
run; only then is the one header it writes (``TRUSTED_PROXY_HEADER``: ``x-forwarded-for``,
``forwarded`` or ``x-real-ip``) believed, never another one, and only as far as the chain
stays inside trusted proxies: walking from the right (the hop nearest to us), the first address
that is not a trusted proxy is the client. Anything to its left was written by the client and
proves nothing. From any other peer forwarded headers are ignored, and ``RealClientMiddleware``
removes them before Django reads them (``SECURE_PROXY_SSL_HEADER``, ``REMOTE_ADDR``).

Users: the ``/metrics`` loopback rule (``is_local``), the mutual-TLS header check (the peer
must be a trusted proxy: ``peer_is_trusted_proxy``) and Django's ``REMOTE_ADDR`` (sign-in
throttling, audit).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.http import HttpRequest
from django.utils.deprecation import MiddlewareMixin

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
UNIX_SOCKET = "unix"  # no address: only processes on this host can connect


@lru_cache(maxsize=4)
def _networks(cidrs: tuple[str, ...]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def parse_ip(value: str | None) -> Address | None:
    """An address from a header token: ``1.2.3.4``, ``[::1]:80``, ``1.2.3.4:5``; else None."""
    if not value:
        return None
    text = value.strip().strip('"')
    if text.startswith("["):
        text = text[1:].split("]", 1)[0]
    elif text.count(":") == 1:
        text = text.split(":", 1)[0]  # IPv4 with a port
    try:
        address: Address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


def is_trusted_proxy(address: str | Address | None) -> bool:
    ip = parse_ip(address) if isinstance(address, str) or address is None else address
    return ip is not None and any(
        ip in net for net in _networks(tuple(settings.TRUSTED_PROXY_CIDRS)))


PROXY_HEADERS = ("x-forwarded-for", "forwarded", "x-real-ip")


def proxy_header() -> str:
    """The one header our proxy writes the client into (``TRUSTED_PROXY_HEADER``)."""
    name = str(getattr(settings, "TRUSTED_PROXY_HEADER", "x-forwarded-for")).lower()
    return name if name in PROXY_HEADERS else "x-forwarded-for"


def _forwarded_for(headers: Iterable[tuple[str, str]]) -> list[str]:
    """The forwarded chain, left (client) to right (nearest proxy), from every copy of the one
    header the deployment names (several header lines are one list, in order).

    Only that header: a proxy appends to its own header and passes the others through (nginx,
    ALB and Envoy pass ``Forwarded`` on untouched), so any other forwarded header is the
    client's writing, and reading it would let the client name itself (review 3, N6).
    """
    wanted = proxy_header()
    chain: list[str] = []
    for name, value in headers:
        if name != wanted:
            continue
        if wanted == "forwarded":
            for element in value.split(","):
                for pair in element.split(";"):
                    key, _, val = pair.strip().partition("=")
                    if key.strip().lower() == "for":
                        chain.append(val.strip())
        else:
            chain.extend(part.strip() for part in value.split(","))
    return chain


def decide(peer: str | None, headers: Iterable[tuple[str, str]]) -> str | None:
    """The client address, given the TCP peer and the (lower-cased) request headers."""
    peer_ip = parse_ip(peer)
    if peer_ip is None or not is_trusted_proxy(peer_ip):
        return str(peer_ip) if peer_ip else peer
    client = peer_ip
    for hop in reversed(_forwarded_for(headers)):
        hop_ip = parse_ip(hop)
        if hop_ip is None:
            break  # garbage or "unknown": stop at the last address we can vouch for
        client = hop_ip
        if not is_trusted_proxy(hop_ip):
            break
    return str(client)


def _scope_headers(scope: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(k.decode("latin-1").lower(), v.decode("latin-1"))
            for k, v in scope.get("headers", ())]


def peer_address(scope: Mapping[str, Any]) -> str | None:
    """The TCP peer (never rewritten: uvicorn runs without proxy headers); None on a socket."""
    client = scope.get("client")
    return str(client[0]) if client else None


def client_address(scope: Mapping[str, Any]) -> str:
    """The client of an ASGI request; ``UNIX_SOCKET`` when it came over a Unix socket."""
    peer = peer_address(scope)
    if peer is None:
        return UNIX_SOCKET
    return decide(peer, _scope_headers(scope)) or peer


def peer_is_trusted_proxy(scope: Mapping[str, Any]) -> bool:
    """May this request carry headers only our proxy may set (client certificates)?"""
    return is_trusted_proxy(peer_address(scope))


def is_local(scope: Mapping[str, Any]) -> bool:
    """The client is on this host: a Unix socket, or loopback after forwarded headers."""
    address = client_address(scope)
    if address == UNIX_SOCKET:
        return True
    ip = parse_ip(address)
    return ip is not None and ip.is_loopback


_FORWARDED_META = ("HTTP_X_FORWARDED_FOR", "HTTP_FORWARDED", "HTTP_X_FORWARDED_PROTO",
                   "HTTP_X_FORWARDED_HOST", "HTTP_X_FORWARDED_PORT", "HTTP_X_REAL_IP")


class RealClientMiddleware(MiddlewareMixin):
    """First in MIDDLEWARE: REMOTE_ADDR becomes the decided client; forwarded headers from a
    peer that is not a trusted proxy are dropped, so Django never builds an https URL or a
    client address from a value the client wrote itself. (MiddlewareMixin: works in the async
    chain without a thread hop.)"""

    def process_request(self, request: HttpRequest) -> None:
        meta = request.META
        peer = meta.get("REMOTE_ADDR") or None
        if peer is None or not is_trusted_proxy(peer):
            for name in _FORWARDED_META:
                meta.pop(name, None)
            return
        headers = [(name[5:].lower().replace("_", "-"), str(value))
                   for name, value in meta.items()
                   if name in ("HTTP_X_FORWARDED_FOR", "HTTP_FORWARDED", "HTTP_X_REAL_IP")]
        meta["REMOTE_ADDR"] = decide(peer, headers) or peer
