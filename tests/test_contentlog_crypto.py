"""Envelope encryption primitives: records bound to tenant and record, DEKs bound to tenant."""

from __future__ import annotations

import base64
import uuid

import pytest

from gateway.contentlog import crypto
from gateway.env import ImproperSetting

K1 = base64.b64encode(b"1" * 32).decode()
K2 = base64.b64encode(b"2" * 32).decode()


@pytest.fixture
def master(settings):
    settings.CONTENT_LOG_MASTER_KEYS = f"k2:{K2},k1:{K1}"
    crypto.reset_keys()
    yield
    crypto.reset_keys()


def test_a_record_opens_only_for_its_tenant_and_record(master):
    dek, rid = crypto.new_dek(), uuid.uuid4()
    blob = crypto.seal_record(dek, 7, rid, b"secret prompt")
    assert crypto.open_record(dek, 7, rid, blob) == b"secret prompt"
    with pytest.raises(crypto.DecryptionError):
        crypto.open_record(dek, 8, rid, blob)  # moved to another tenant
    with pytest.raises(crypto.DecryptionError):
        crypto.open_record(dek, 7, uuid.uuid4(), blob)  # moved to another record
    with pytest.raises(crypto.DecryptionError):
        crypto.open_record(crypto.new_dek(), 7, rid, blob)  # another key


def test_a_flipped_bit_is_detected(master):
    dek, rid = crypto.new_dek(), uuid.uuid4()
    blob = bytearray(crypto.seal_record(dek, 1, rid, b"x" * 100))
    blob[20] ^= 1
    with pytest.raises(crypto.DecryptionError):
        crypto.open_record(dek, 1, rid, bytes(blob))


def test_every_seal_uses_a_fresh_nonce(master):
    dek, rid = crypto.new_dek(), uuid.uuid4()
    nonces = {crypto.seal_record(dek, 1, rid, b"same")[:12] for _ in range(200)}
    assert len(nonces) == 200


def test_deks_are_wrapped_by_the_newest_master_and_bound_to_tenant_and_version(master):
    dek = crypto.new_dek()
    kid, wrapped = crypto.wrap_dek(dek, 3, 1)
    assert kid == "k2"
    assert dek not in wrapped
    assert crypto.unwrap_dek(kid, wrapped, 3, 1) == dek
    for tenant, version in ((4, 1), (3, 2)):
        with pytest.raises(crypto.DecryptionError):
            crypto.unwrap_dek(kid, wrapped, tenant, version)


def test_a_retired_master_key_cannot_unwrap(master, settings):
    dek = crypto.new_dek()
    kid, wrapped = crypto.wrap_dek(dek, 3, 1)
    settings.CONTENT_LOG_MASTER_KEYS = f"k3:{K1}"
    crypto.reset_keys()
    with pytest.raises(crypto.DecryptionError):
        crypto.unwrap_dek(kid, wrapped, 3, 1)


@pytest.mark.parametrize("value", [
    "nokid", "k1:notbase64!!", f"k1:{base64.b64encode(b'short').decode()}", f"k1:{K1},k1:{K2}",
    f":{K1}",
])
def test_bad_master_key_settings_are_refused(value):
    with pytest.raises(ImproperSetting):
        crypto.parse_master_keys(value)


def test_without_configured_keys_a_dev_key_is_generated_once(settings, tmp_path, caplog):
    settings.CONTENT_LOG_MASTER_KEYS = ""
    settings.VAR_DIR = tmp_path
    crypto.reset_keys()
    try:
        first = crypto.current_master()
        crypto.reset_keys()
        assert crypto.current_master() == first
        assert (tmp_path / crypto.DEV_KEY_FILE).stat().st_mode & 0o077 == 0
        assert "CONTENT_LOG_MASTER_KEYS is not set" in caplog.text
    finally:
        crypto.reset_keys()


def test_transit_items_are_bound_to_tenant_and_request(master):
    kid, blob = crypto.seal_transit(5, "req-1", b"hello")
    assert b"hello" not in blob
    assert crypto.open_transit(kid, 5, "req-1", blob) == b"hello"
    with pytest.raises(crypto.DecryptionError):
        crypto.open_transit(kid, 6, "req-1", blob)
