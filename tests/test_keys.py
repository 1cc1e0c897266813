"""API key format, checksum, entropy, hashing, pepper rotation, and no plaintext at rest."""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import math
import re
from collections import Counter

import pytest
from django.core.management import call_command
from django.db import connection

from tenants import api_keys as keys
from tenants.api_keys import ALPHABET, generate_key, hash_key, issue_key, parse_key
from tenants.auth import AuthError, authenticate, clear_cache, flush_last_used
from tenants.models import ApiKey
from tests.factories import bearer, make_key, make_model, make_tenant

KEY_RE = re.compile(r"igw_[0-9A-Za-z]{43}_[0-9A-Za-z]{6}")


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_cache()
    yield
    clear_cache()


def test_format_prefix_body_checksum():
    key = generate_key()
    assert KEY_RE.fullmatch(key), key
    parsed = parse_key(key)
    assert parsed is not None
    assert (parsed.prefix, len(parsed.body), len(parsed.checksum)) == ("igw", 43, 6)
    assert parsed.checksum == keys.checksum(parsed.body)


def test_prefix_follows_settings(settings):
    settings.API_KEY_PREFIX = "acme"
    key = generate_key()
    assert key.startswith("acme_") and parse_key(key) is not None
    settings.API_KEY_PREFIX = "igw"
    assert parse_key(key) is None  # another deployment's key is not ours


def test_thousand_keys_distinct_and_high_entropy():
    generated = [generate_key() for _ in range(1000)]
    assert len(set(generated)) == 1000
    assert len({k[:12] for k in generated}) == 1000  # display prefixes identify keys too
    # Skip the leading digit: 2**256 is just under 62**43, so it is not uniform by design.
    chars = Counter(c for k in generated for c in parse_key(k).body[1:])
    total = sum(chars.values())
    entropy = -sum(n / total * math.log2(n / total) for n in chars.values())
    assert set(chars) == set(ALPHABET)
    assert entropy > math.log2(62) - 0.02  # 5.954 bits per char when uniform
    assert 43 * math.log2(62) >= 256


def test_checksum_detects_every_single_character_change():
    key = generate_key()
    for pos, original in enumerate(key):
        for replacement in ALPHABET + "_":
            if replacement == original:
                continue
            mutated = key[:pos] + replacement + key[pos + 1:]
            assert parse_key(mutated) is None, (pos, replacement)


@pytest.mark.parametrize("junk", [
    "", "igw", "igw_", "igw__", "sk-abc123", "Bearer igw_x_y", "igw_" + "a" * 43,
    "igw_" + "a" * 43 + "_", "igw_" + "a" * 43 + "_" + "a" * 7, "x" * 10_000,
    "igw_" + "é" * 43 + "_aaaaaa", "igw_a_b_c",
])
def test_malformed_keys_parse_to_none(junk):
    assert parse_key(junk) is None


def test_body_with_valid_checksum_but_wrong_length_is_rejected():
    body = "a" * 42
    assert parse_key(f"igw_{body}_{keys.checksum(body)}") is None


def test_hash_is_hmac_sha256_under_the_versioned_pepper(settings):
    settings.API_KEY_PEPPERS = {1: "first-pepper-0123456789", 2: "second-pepper-0123456789"}
    key = generate_key()
    expected = hmac.new(b"second-pepper-0123456789", key.encode(), hashlib.sha256).hexdigest()
    assert hash_key(key, 2) == expected
    assert hash_key(key, 1) != hash_key(key, 2)
    assert hash_key(key, 2) == hash_key(key, 2)


@pytest.mark.django_db
def test_issue_key_stores_only_hash_and_display_parts(settings):
    settings.API_KEY_PEPPERS = {1: "first-pepper-0123456789", 3: "third-pepper-0123456789"}
    api_key, plaintext = make_key()
    api_key.refresh_from_db()
    assert api_key.pepper_version == 3
    assert api_key.key_hash == hash_key(plaintext, 3)
    assert api_key.prefix == plaintext[:12]
    assert api_key.last_four == plaintext[-4:]
    assert api_key.masked == f"{plaintext[:12]}…{plaintext[-4:]}"
    assert str(api_key).endswith(api_key.masked + ")")


@pytest.mark.django_db
def test_pepper_rotation_old_keys_verify_new_keys_use_new_version(settings, redis_client):
    settings.API_KEY_PEPPERS = {1: "old-pepper-0123456789abc"}
    tenant = make_tenant()
    old_key, old_plain = make_key(tenant)
    assert old_key.pepper_version == 1

    settings.API_KEY_PEPPERS = {2: "new-pepper-0123456789abc", 1: "old-pepper-0123456789abc"}
    clear_cache()
    new_key, new_plain = make_key(tenant)
    assert new_key.pepper_version == 2
    assert authenticate(bearer(old_plain)).key_id == old_key.pk
    assert authenticate(bearer(new_plain)).key_id == new_key.pk

    # Retiring pepper 1 retires the keys hashed under it.
    settings.API_KEY_PEPPERS = {2: "new-pepper-0123456789abc"}
    clear_cache()
    with pytest.raises(AuthError) as err:
        authenticate(bearer(old_plain))
    assert err.value.status == 401
    assert authenticate(bearer(new_plain)).key_id == new_key.pk


def _every_cell_as_text() -> list[tuple[str, str, str]]:
    """(table, column, text) for every column of every row of every table in the database."""
    cells = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")
            columns = [c[0] for c in cursor.description]
            for row in cursor.fetchall():
                for column, value in zip(columns, row, strict=True):
                    if isinstance(value, memoryview | bytes):
                        value = bytes(value).decode("latin-1")
                    cells.append((table, column, str(value)))
    return cells


@pytest.mark.django_db
def test_no_plaintext_anywhere_in_the_database(admin_client, redis_client, caplog):
    caplog.set_level(logging.DEBUG)
    tenant = make_tenant("scan")
    model = make_model()
    plaintexts = [make_key(tenant, allowed_models=[model])[1]]
    out = io.StringIO()
    call_command("issue_key", "scan", "--name", "cli", stdout=out, stderr=io.StringIO())
    plaintexts.append(out.getvalue().strip())
    response = admin_client.post("/admin/tenants/apikey/add/", {
        "tenant": tenant.pk, "name": "from admin", "allowed_models": [model.pk],
        "expires_at_0": "", "expires_at_1": "",
    }, follow=True)  # POST-redirect-GET: the GET shows the key once and drops it from the session
    plaintexts.append(KEY_RE.search(response.content.decode()).group(0))
    for plaintext in plaintexts:
        assert authenticate(bearer(plaintext)).tenant_id == tenant.pk
    flush_last_used()
    assert ApiKey.objects.filter(tenant=tenant).count() == 3

    secrets_ = [s for p in plaintexts for s in (p, parse_key(p).body)]
    cells = _every_cell_as_text()
    tables = {t for t, _, _ in cells}
    assert {"tenants_apikey", "django_admin_log", "django_session"} <= tables  # scan is real
    leaks = [(t, c) for t, c, text in cells for s in secrets_ if s in text]
    assert leaks == []
    assert not [r for r in caplog.records for s in secrets_ if s in r.getMessage()]


@pytest.mark.django_db
def test_issue_key_sets_models_expiry_and_caps():
    tenant = make_tenant()
    model = make_model("sim-tiny")
    api_key, plaintext = issue_key(tenant, "scoped", allowed_models=[model], input_tpm=1000)
    api_key.refresh_from_db()
    assert list(api_key.allowed_models.all()) == [model]
    assert api_key.input_tpm == 1000 and api_key.output_tpm is None
    assert plaintext not in {api_key.key_hash, api_key.prefix, api_key.last_four}


@pytest.mark.django_db
def test_rotate_key_copies_the_key_and_never_extends_the_old_one():
    from datetime import timedelta

    from django.utils import timezone

    tenant, model = make_tenant(), make_model()
    soon = timezone.now() + timedelta(hours=1)
    old, _ = issue_key(tenant, "ci", allowed_models=[model], expires_at=soon, input_tpm=500)
    new, plaintext = keys.rotate_key(old, timedelta(days=7))
    assert (new.name, new.expires_at, new.input_tpm) == ("ci", soon, 500)
    assert list(new.allowed_models.all()) == [model]
    assert authenticate(bearer(plaintext)).key_id == new.pk
    old.refresh_from_db()
    assert old.expires_at == soon  # a 7-day grace does not outlive the hour it had left
    keys.rotate_key(new, timedelta(seconds=60))
    new.refresh_from_db()
    assert new.expires_at <= timezone.now() + timedelta(seconds=60)


@pytest.mark.django_db
def test_a_revoked_key_is_not_rotated():
    from datetime import timedelta

    old, _ = make_key()
    stale = ApiKey.objects.get(pk=old.pk)  # a copy loaded before the revocation
    old.revoke()
    with pytest.raises(keys.KeyNotRotatable):
        keys.rotate_key(stale, timedelta(hours=1))
    assert ApiKey.objects.count() == 1
    stale.refresh_from_db()
    assert stale.expires_at is None and stale.revoked_at is not None
