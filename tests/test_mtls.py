"""Mutual TLS behind a proxy: certificate headers count only from TRUSTED_PROXY_CIDRS."""

from __future__ import annotations

import datetime as dt
import hashlib
from urllib.parse import quote

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from django.core.exceptions import ValidationError
from django.utils import timezone

from tenants import auth, mtls
from tenants.auth import AuthError, authenticate_request
from tenants.models import ClientCertificate
from tests.factories import make_tenant

PROXY = "10.0.0.5"
OUTSIDER = "198.51.100.7"


def self_signed() -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "client.acme.example")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    return pem, hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


@pytest.fixture(autouse=True)
def proxies(settings):
    settings.TRUSTED_PROXY_CIDRS = ["10.0.0.0/24", "fd00::/64"]
    auth.clear_cache()
    yield


@pytest.fixture
def bound(db, redis_client):
    pem, fingerprint = self_signed()
    binding = ClientCertificate.objects.create(
        tenant=make_tenant("acme"), name="billing job", fingerprint_sha256=fingerprint)
    return pem, fingerprint, binding


@pytest.mark.parametrize("ip,trusted", [
    ("10.0.0.5", True), ("10.0.0.255", True), ("10.0.1.1", False), ("198.51.100.7", False),
    ("fd00::1", True), ("::ffff:10.0.0.9", True), ("", False), (None, False), ("junk", False),
])
def test_only_configured_proxies_are_trusted(ip, trusted):
    assert mtls.is_trusted_proxy(ip) is trusted


def test_the_fingerprint_header_from_a_trusted_proxy_authenticates(bound):
    _, fingerprint, binding = bound
    colons = ":".join(fingerprint[i:i + 2] for i in range(0, 64, 2)).upper()
    principal = authenticate_request({"X-SSL-Client-Fingerprint": colons}, PROXY)
    assert principal.tenant_id == binding.tenant_id
    assert principal.key_id == mtls.synthetic_key_id(binding.pk) < 0
    assert principal.key_id % 2 == 1  # odd: never the id of an OIDC registration


def test_the_certificate_header_from_a_trusted_proxy_authenticates(bound):
    pem, _, binding = bound
    principal = authenticate_request({"x-ssl-client-cert": quote(pem)}, PROXY)
    assert principal.tenant_id == binding.tenant_id


@pytest.mark.parametrize("header", ["X-SSL-Client-Fingerprint", "X-SSL-Client-Cert"])
def test_the_same_headers_from_anyone_else_are_ignored(bound, header):
    pem, fingerprint, _ = bound
    value = fingerprint if header.endswith("Fingerprint") else quote(pem)
    with pytest.raises(AuthError) as err:
        authenticate_request({header: value}, OUTSIDER)
    assert err.value.status == 401


def test_no_trusted_proxies_configured_means_no_mtls(bound, settings):
    settings.TRUSTED_PROXY_CIDRS = []
    with pytest.raises(AuthError):
        authenticate_request({"X-SSL-Client-Fingerprint": bound[1]}, PROXY)


def test_an_unbound_revoked_or_expired_certificate_is_refused(bound):
    _, fingerprint, binding = bound
    with pytest.raises(AuthError):
        authenticate_request({"X-SSL-Client-Fingerprint": "ab" * 32}, PROXY)
    binding.revoked_at = timezone.now()
    binding.save()
    with pytest.raises(AuthError):
        authenticate_request({"X-SSL-Client-Fingerprint": fingerprint}, PROXY)
    binding.revoked_at, binding.expires_at = None, timezone.now() - dt.timedelta(seconds=1)
    binding.save()
    with pytest.raises(AuthError):
        authenticate_request({"X-SSL-Client-Fingerprint": fingerprint}, PROXY)


def test_a_bad_api_key_is_not_rescued_by_a_certificate(bound):
    with pytest.raises(AuthError):
        authenticate_request({"Authorization": "Bearer igw-wrong",
                              "X-SSL-Client-Fingerprint": bound[1]}, PROXY)


def test_the_header_name_is_configurable(bound, settings):
    settings.MTLS_FINGERPRINT_HEADER = "X-Client-Cert-Sha256"
    assert authenticate_request({"X-Client-Cert-Sha256": bound[1]}, PROXY).tenant_id == \
        bound[2].tenant_id


@pytest.mark.parametrize("value,expected", [
    ("AB" * 32, "ab" * 32), (":".join(["ab"] * 32), "ab" * 32), ("sha256:" + "0f" * 32, "0f" * 32),
    ("ab" * 31, None), ("zz" * 32, None), ("", None), (None, None),
])
def test_fingerprints_are_normalized(value, expected):
    assert mtls.normalize_fingerprint(value) == expected


def test_a_binding_with_a_bad_fingerprint_does_not_validate(db):
    cert = ClientCertificate(tenant=make_tenant(), name="x", fingerprint_sha256="nope")
    with pytest.raises(ValidationError):
        cert.clean()


@pytest.mark.django_db(transaction=True)  # database_sync_to_async uses its own connection
def test_scope_headers_and_peer_come_from_the_asgi_scope(bound):
    from asgiref.sync import async_to_sync

    scope = {"headers": [(b"x-ssl-client-fingerprint", bound[1].encode())],
             "client": (PROXY, 51000)}
    principal = async_to_sync(auth.aauthenticate_scope_request)(scope)
    assert principal.tenant_id == bound[2].tenant_id
    scope["client"] = (OUTSIDER, 51000)
    with pytest.raises(AuthError):
        async_to_sync(auth.aauthenticate_scope_request)(scope)
