"""Envelope encryption for the content log (docs/adr/0004).

Three layers of keys:

- **Master keys** come from configuration (``CONTENT_LOG_MASTER_KEYS="kid2:<b64>,kid1:<b64>"``,
  newest first; ``_FILE`` works too). They never touch the database. The newest wraps; every
  listed key can unwrap, so rotation is: prepend a new key, run ``rotate_master_key``, drop the
  old one once nothing (and no backup you still care about) is wrapped with it.
- **Tenant data keys (DEKs)**, AES-256, one live version per tenant, stored only wrapped
  (AES-GCM under a master key, associated data = tenant id + version + master key id).
- **Records**, sealed with AES-256-GCM under the tenant's DEK with a fresh 96-bit random nonce
  and associated data = tenant id + record id, so a ciphertext copied onto another tenant's or
  another record's row fails authentication.

A transit key (HKDF of the newest master key) seals items on their way through Redis, so a
prompt never sits in Redis or its RDB/AOF files in the clear.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import secrets
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

from gateway.env import ImproperSetting

log = logging.getLogger(__name__)

NONCE_BYTES = 12  # 96-bit, random per seal: 2^32 seals per key stay far below collision risk
KEY_BYTES = 32
DEV_KEY_FILE = "contentlog-dev-master.key"


class DecryptionError(Exception):
    """A ciphertext did not authenticate: wrong key, wrong tenant/record, tampered or shredded."""


@dataclass(frozen=True)
class MasterKey:
    kid: str
    secret: bytes


def parse_master_keys(value: str, name: str = "CONTENT_LOG_MASTER_KEYS") -> list[MasterKey]:
    """``"kid2:<base64 32 bytes>,kid1:<...>"`` -> keys, newest first. Refuses anything else."""
    keys: list[MasterKey] = []
    for part in value.split(","):
        kid, sep, b64 = part.strip().partition(":")
        try:
            secret = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            secret = b""
        if not sep or not kid or not kid.replace("-", "").replace("_", "").isalnum() or \
                len(secret) != KEY_BYTES:
            raise ImproperSetting(f"{name} must look like 'kid2:<base64 of 32 bytes>,kid1:<...>'")
        if any(k.kid == kid for k in keys):
            raise ImproperSetting(f"{name} lists key id {kid!r} twice")
        keys.append(MasterKey(kid, secret))
    return keys


def generate_master_key_entry(kid: str) -> str:
    """A fresh ``kid:<base64>`` entry for CONTENT_LOG_MASTER_KEYS."""
    return f"{kid}:{base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()}"


@lru_cache(maxsize=1)
def master_keys() -> tuple[MasterKey, ...]:
    configured = settings.CONTENT_LOG_MASTER_KEYS
    if configured:
        return tuple(parse_master_keys(configured))
    return (_dev_master_key(Path(settings.VAR_DIR)),)


def _dev_master_key(var_dir: Path) -> MasterKey:
    # Development only: a generated key beside the SQLite file. Losing it loses the log.
    path = var_dir / DEV_KEY_FILE
    if not path.exists():
        var_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(generate_master_key_entry("dev1"))
    log.warning("CONTENT_LOG_MASTER_KEYS is not set: using the development key in %s", path)
    return parse_master_keys(path.read_text().strip(), str(path))[0]


def reset_keys() -> None:
    """Forget cached master keys (tests, and after a settings change in-process)."""
    master_keys.cache_clear()
    _transit_aead.cache_clear()


def current_master() -> MasterKey:
    return master_keys()[0]


def _master(kid: str) -> MasterKey:
    for mk in master_keys():
        if mk.kid == kid:
            return mk
    raise DecryptionError(f"master key {kid!r} is not configured (retired?)")


def _open(key: bytes, blob: bytes, aad: bytes) -> bytes:
    try:
        return AESGCM(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], aad)
    except (InvalidTag, ValueError) as exc:
        raise DecryptionError("ciphertext did not authenticate") from exc


def _seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


# --- tenant data keys ------------------------------------------------------------------------

def new_dek() -> bytes:
    return AESGCM.generate_key(bit_length=256)


def _dek_aad(tenant_id: int, version: int, kid: str) -> bytes:
    return f"contentlog-dek:v1|tenant:{tenant_id}|version:{version}|kid:{kid}".encode()


def wrap_dek(dek: bytes, tenant_id: int, version: int) -> tuple[str, bytes]:
    """Wrap a DEK under the newest master key -> (master key id, nonce + ciphertext)."""
    mk = current_master()
    return mk.kid, _seal(mk.secret, dek, _dek_aad(tenant_id, version, mk.kid))


# BinaryField values read back from PostgreSQL are memoryviews.
def unwrap_dek(kid: str, wrapped: bytes | memoryview, tenant_id: int, version: int) -> bytes:
    return _open(_master(kid).secret, bytes(wrapped), _dek_aad(tenant_id, version, kid))


# --- records ---------------------------------------------------------------------------------

def _record_aad(tenant_id: int, record_id: object) -> bytes:
    return f"contentlog-record:v1|tenant:{tenant_id}|record:{record_id}".encode()


def seal_record(dek: bytes, tenant_id: int, record_id: object, plaintext: bytes) -> bytes:
    return _seal(dek, plaintext, _record_aad(tenant_id, record_id))


def open_record(dek: bytes, tenant_id: int, record_id: object,
                blob: bytes | memoryview) -> bytes:
    return _open(dek, bytes(blob), _record_aad(tenant_id, record_id))


# --- transit through Redis -------------------------------------------------------------------

@lru_cache(maxsize=8)
def _transit_aead(kid: str) -> AESGCM:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                info=b"inference-gateway contentlog transit v1")
    return AESGCM(hkdf.derive(_master(kid).secret))


def seal_transit(tenant_id: int, request_id: str, plaintext: bytes) -> tuple[str, bytes]:
    kid = current_master().kid
    nonce = secrets.token_bytes(NONCE_BYTES)
    aad = f"contentlog-transit:v1|tenant:{tenant_id}|request:{request_id}".encode()
    return kid, nonce + _transit_aead(kid).encrypt(nonce, plaintext, aad)


def open_transit(kid: str, tenant_id: int, request_id: str, blob: bytes) -> bytes:
    aad = f"contentlog-transit:v1|tenant:{tenant_id}|request:{request_id}".encode()
    try:
        return _transit_aead(kid).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], aad)
    except (InvalidTag, ValueError) as exc:
        raise DecryptionError("transit item did not authenticate") from exc
