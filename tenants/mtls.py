"""Mutual TLS behind a TLS-terminating proxy: a client certificate bound to a tenant.

The proxy (nginx, Envoy, an ALB) verifies the TLS handshake and forwards the client
certificate (``MTLS_CERT_HEADER``, URL-encoded PEM as nginx's ``$ssl_client_escaped_cert``) or
its SHA-256 fingerprint (``MTLS_FINGERPRINT_HEADER``). Anyone can send those headers, so they
are read **only when the TCP peer is in ``TRUSTED_PROXY_CIDRS``**; from any other address they
are ignored as if absent. The proxy must also overwrite (not append to) these headers on every
request, or a client could pass its own value through it.

A binding pins the exact certificate (fingerprint of its DER), so it holds even when the proxy
accepts certificates from any CA (nginx ``ssl_verify_client optional_no_ca``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from urllib.parse import unquote

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from infra import clientaddr
from tenants.fingerprints import normalize_fingerprint
from tenants.models import ClientCertificate


def synthetic_key_id(binding_id: int) -> int:
    """Odd negatives for certificates (OIDC registrations take even ones)."""
    return -(2 * binding_id + 1)


def fingerprint_of_pem(pem: str) -> str | None:
    """SHA-256 of the certificate's DER, from a (possibly URL-encoded) PEM header value."""
    text = unquote(pem) if "%" in pem else pem
    try:
        cert = x509.load_pem_x509_certificate(text.encode())
    except ValueError:
        return None
    return hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()


def is_trusted_proxy(peer_ip: str | None) -> bool:
    """The TCP peer (``infra.clientaddr.peer_address``, never a forwarded value) is our proxy."""
    return clientaddr.is_trusted_proxy(peer_ip)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    wanted = name.lower()
    values = [v for k, v in headers.items() if k.lower() == wanted]
    return values[0] if len(values) == 1 else None


def client_fingerprint(headers: Mapping[str, str], peer_ip: str | None) -> str | None:
    """The forwarded certificate's fingerprint, or None (no header, or not from a proxy)."""
    if not is_trusted_proxy(peer_ip):
        return None
    pem = _header(headers, settings.MTLS_CERT_HEADER)
    if pem:
        return fingerprint_of_pem(pem)
    return normalize_fingerprint(_header(headers, settings.MTLS_FINGERPRINT_HEADER))


def binding_for(fingerprint: str) -> ClientCertificate | None:
    now = timezone.now()
    return (ClientCertificate.objects.select_related("tenant__tier")
            .filter(fingerprint_sha256=fingerprint, revoked_at__isnull=True)
            .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now)).first())


def bindings_for_tenant(tenant: object) -> list[ClientCertificate]:
    """The portal's view of one tenant's certificate bindings."""
    return list(ClientCertificate.objects.filter(tenant_id=getattr(tenant, "pk", tenant)))
