"""The content log: opt-in write path, drain, rotation, re-encryption, shredding, retention."""

from __future__ import annotations

import base64
import json
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.utils import timezone

from gateway.contentlog import crypto, keys, lifecycle, store
from gateway.contentlog.models import AuditEntry, ContentRecord, TenantKey
from tests.factories import make_tenant

K1 = base64.b64encode(b"a" * 32).decode()
K2 = base64.b64encode(b"b" * 32).decode()
PROMPT = [{"role": "user", "content": "my password is hunter2"}]
RESPONSE = "Please never share hunter2."


@pytest.fixture(autouse=True)
def master(settings):
    settings.CONTENT_LOG_MASTER_KEYS = f"k1:{K1}"
    crypto.reset_keys()
    yield
    crypto.reset_keys()


def opted_in(**kw):
    tenant = make_tenant(**kw)
    tenant.content_logging = True
    tenant.save()
    return tenant


def _read(record: ContentRecord) -> dict:
    return store.decrypt_record(record)


@pytest.mark.django_db
def test_nothing_is_queued_for_a_tenant_that_did_not_opt_in(redis_client):
    tenant = make_tenant()
    assert store.enqueue_content("r1", tenant.pk, PROMPT, RESPONSE) is False
    assert store.enqueue_content("r2", tenant.pk, PROMPT, RESPONSE, opted_in=False) is False
    assert redis_client.llen(store.pending_key()) == 0


@pytest.mark.django_db
def test_an_opted_in_exchange_is_queued_sealed_and_written_encrypted(redis_client):
    tenant = opted_in()
    assert store.enqueue_content("req-1", tenant.pk, PROMPT, RESPONSE)
    raw = redis_client.lrange(store.pending_key(), 0, -1)
    assert len(raw) == 1 and b"hunter2" not in raw[0]  # no plaintext in Redis
    assert store.drain_all() == 1
    record = ContentRecord.objects.get(tenant=tenant)
    assert record.request_id == "req-1"
    assert b"hunter2" not in bytes(record.ciphertext)
    assert _read(record) == {"prompt": PROMPT, "response": RESPONSE}
    assert record.expires_at - record.created_at == timedelta(days=7)
    assert store.stats()["written"] == 1


@pytest.mark.django_db
def test_the_async_enqueue_matches_the_sync_one(redis_client):
    tenant = opted_in()
    ok = async_to_sync(store.aenqueue_content)("req-a", tenant.pk, "p", "r", opted_in=True)
    assert ok and store.drain_all() == 1
    assert _read(ContentRecord.objects.get(request_id="req-a")) == {"prompt": "p", "response": "r"}


@pytest.mark.django_db
def test_an_opt_out_before_the_drain_discards_the_item(redis_client):
    tenant = opted_in()
    store.enqueue_content("req-1", tenant.pk, PROMPT, RESPONSE, opted_in=True)
    tenant.content_logging = False
    tenant.save()
    assert store.drain_all() == 0
    assert not ContentRecord.objects.exists()
    assert redis_client.llen(store.pending_key()) == 0


@pytest.mark.django_db
def test_a_failed_write_is_counted_kept_and_retried(redis_client, monkeypatch):
    tenant = opted_in()
    store.enqueue_content("req-1", tenant.pk, PROMPT, RESPONSE)
    real = ContentRecord.objects.bulk_create
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("database went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(ContentRecord.objects, "bulk_create", flaky)
    first = store.drain()
    assert first.claimed == 1 and first.written == 0
    assert store.stats()["write_failures"] == 1
    assert redis_client.llen(store.processing_key()) == 1
    store.drain()
    assert ContentRecord.objects.filter(request_id="req-1").count() == 1
    assert redis_client.llen(store.processing_key()) == 0


@pytest.mark.django_db
def test_a_replayed_batch_writes_each_request_once(redis_client):
    tenant = opted_in()
    for _ in range(2):
        store.enqueue_content("same", tenant.pk, PROMPT, RESPONSE)
    store.drain_all()
    assert ContentRecord.objects.filter(request_id="same").count() == 1


@pytest.mark.django_db
def test_enqueue_never_raises_and_counts_the_failure(redis_client, monkeypatch):
    tenant = opted_in()
    monkeypatch.setattr(store, "_item", lambda *a: (_ for _ in ()).throw(OSError("boom")))
    assert store.enqueue_content("r", tenant.pk, PROMPT, RESPONSE, opted_in=True) is False
    assert store.stats()["enqueue_failures"] == 1


@pytest.mark.django_db
def test_the_backlog_is_bounded(redis_client, settings):
    settings.CONTENT_LOG_MAX_PENDING = 3
    tenant = opted_in()
    queued = [store.enqueue_content(f"r{i}", tenant.pk, "p", "r", opted_in=True)
              for i in range(5)]
    assert queued == [True, True, True, False, False]
    assert store.stats()["dropped_backlog_full"] == 2


@pytest.mark.django_db
def test_a_poison_item_is_dropped_and_the_rest_written(redis_client):
    tenant = opted_in()
    store.enqueue_content("good", tenant.pk, "p", "r")
    redis_client.rpush(store.pending_key(), json.dumps({"r": "bad", "t": tenant.pk, "k": "k1",
                                                        "c": base64.b64encode(b"x" * 40).decode()}))
    assert store.drain_all() == 1
    assert store.stats()["dropped_unreadable"] == 1


@pytest.mark.django_db
def test_master_key_rotation_rewraps_deks_without_touching_records(settings):
    tenant = opted_in()
    record = store.write_record(tenant.pk, "r1", "p", "r")
    before = bytes(ContentRecord.objects.get(pk=record.pk).ciphertext)
    settings.CONTENT_LOG_MASTER_KEYS = f"k2:{K2},k1:{K1}"
    crypto.reset_keys()
    assert keys.rewrap_all() == 1
    assert TenantKey.objects.get(tenant=tenant).master_kid == "k2"
    assert bytes(ContentRecord.objects.get(pk=record.pk).ciphertext) == before
    settings.CONTENT_LOG_MASTER_KEYS = f"k2:{K2}"  # k1 retired: still readable
    crypto.reset_keys()
    assert _read(ContentRecord.objects.get(pk=record.pk))["prompt"] == "p"


@pytest.mark.django_db
def test_reencryption_moves_every_record_to_a_new_dek_and_destroys_the_old():
    tenant = opted_in()
    ids = [store.write_record(tenant.pk, f"r{i}", f"p{i}", "r").pk for i in range(5)]
    old = {r.pk: bytes(r.ciphertext) for r in ContentRecord.objects.all()}
    assert lifecycle.reencrypt_tenant(tenant, batch=2) == 5
    assert list(TenantKey.objects.filter(tenant=tenant).values_list("version", flat=True)) == [2]
    for i, pk in enumerate(ids):
        row = ContentRecord.objects.get(pk=pk)
        assert row.key_version == 2 and bytes(row.ciphertext) != old[pk]
        assert _read(row)["prompt"] == f"p{i}"


def _restore(rows: list[dict]) -> list[ContentRecord]:
    return [ContentRecord(**row) for row in rows]


@pytest.mark.django_db
def test_shredding_makes_a_backup_of_the_records_unreadable():
    tenant = opted_in()
    store.write_record(tenant.pk, "r1", PROMPT, RESPONSE)
    backup = list(ContentRecord.objects.values())  # a backup taken before shredding
    assert _read(_restore(backup)[0])["response"] == RESPONSE
    destroyed, deleted = lifecycle.shred_tenant_content(tenant, actor="test")
    assert (destroyed, deleted) == (1, 1)
    assert not TenantKey.objects.filter(tenant=tenant).exists()
    for row in _restore(backup):
        with pytest.raises(crypto.DecryptionError):
            _read(row)
    assert AuditEntry.objects.filter(tenant_id=tenant.pk, action="shredded").exists()


@pytest.mark.django_db
def test_a_backup_of_the_key_table_is_dead_once_its_master_key_is_retired(settings):
    tenant = opted_in()
    store.write_record(tenant.pk, "r1", PROMPT, RESPONSE)
    record_backup = list(ContentRecord.objects.values())
    key_backup = list(TenantKey.objects.values())
    lifecycle.shred_tenant_content(tenant)
    # Rotate away from k1 and retire it, as ADR 0004 prescribes after a shred.
    settings.CONTENT_LOG_MASTER_KEYS = f"k2:{K2}"
    crypto.reset_keys()
    kb, rb = key_backup[0], record_backup[0]
    with pytest.raises(crypto.DecryptionError):
        crypto.unwrap_dek(kb["master_kid"], kb["wrapped_dek"], tenant.pk, kb["version"])
    # and the record still names a key version nobody holds
    with pytest.raises(crypto.DecryptionError):
        keys.dek_for(tenant.pk, rb["key_version"])


@pytest.mark.django_db
def test_deleting_the_tenant_destroys_its_keys_and_records():
    tenant = opted_in()
    store.write_record(tenant.pk, "r1", "p", "r")
    backup = list(ContentRecord.objects.values())
    tenant_id = tenant.pk
    tenant.delete()
    assert not TenantKey.objects.filter(tenant_id=tenant_id).exists()
    assert not ContentRecord.objects.filter(tenant_id=tenant_id).exists()
    with pytest.raises(crypto.DecryptionError):
        _read(_restore(backup)[0])


@pytest.mark.django_db
def test_retention_purges_only_expired_records_with_a_moved_clock():
    short, long_ = opted_in(), opted_in()
    lifecycle.set_retention_days(long_, 30)
    t0 = timezone.now()
    store.write_record(short.pk, "s", "p", "r", now=t0)
    store.write_record(long_.pk, "l", "p", "r", now=t0)
    assert lifecycle.purge_expired(now=t0 + timedelta(days=6, hours=23)) == 0
    assert lifecycle.purge_expired(now=t0 + timedelta(days=7, seconds=1)) == 1
    assert list(ContentRecord.objects.values_list("request_id", flat=True)) == ["l"]
    assert lifecycle.purge_expired(now=t0 + timedelta(days=30, seconds=1)) == 1
    assert not ContentRecord.objects.exists()


@pytest.mark.django_db
def test_purging_works_in_batches():
    tenant = opted_in()
    t0 = timezone.now()
    for i in range(7):
        store.write_record(tenant.pk, f"r{i}", "p", "r", now=t0)
    assert lifecycle.purge_expired(now=t0 + timedelta(days=8), batch=3) == 7


@pytest.mark.django_db
def test_shortening_retention_applies_to_existing_records():
    tenant = opted_in()
    lifecycle.set_retention_days(tenant, 30)
    t0 = timezone.now()
    store.write_record(tenant.pk, "r", "p", "r", now=t0)
    lifecycle.set_retention_days(tenant, 2)
    assert lifecycle.purge_expired(now=t0 + timedelta(days=2, seconds=1)) == 1


@pytest.mark.django_db
@pytest.mark.parametrize("days", [0, 31])
def test_retention_outside_1_to_30_days_is_refused(days):
    with pytest.raises(ValueError):
        lifecycle.set_retention_days(opted_in(), days)


@pytest.mark.django_db
def test_the_admin_never_renders_content(client):
    tenant = opted_in()
    record = store.write_record(tenant.pk, "r1", "TOPSECRETPROMPT", "TOPSECRETANSWER")
    admin = get_user_model().objects.create_superuser("root", "root@example.com", "pw-123456")
    client.force_login(admin)
    pages = ["/admin/contentlog/contentrecord/",
             f"/admin/contentlog/contentrecord/{record.pk}/change/",
             "/admin/contentlog/tenantkey/"]
    for url in pages:
        response = client.get(url)
        assert response.status_code == 200, url
        body = response.content
        assert b"TOPSECRET" not in body and bytes(record.ciphertext)[:16] not in body
    assert client.post(f"/admin/contentlog/contentrecord/{record.pk}/delete/").status_code == 403


@pytest.mark.django_db
def test_the_management_commands_rotate_and_shred(settings):
    from io import StringIO

    from django.core.management import CommandError, call_command

    tenant = opted_in()
    store.write_record(tenant.pk, "r1", "p", "r")
    out = StringIO()
    call_command("rotate_master_key", "--generate", "k9", stdout=out)
    entry = out.getvalue().strip()
    assert crypto.parse_master_keys(entry)[0].kid == "k9"
    settings.CONTENT_LOG_MASTER_KEYS = f"{entry},k1:{K1}"
    crypto.reset_keys()
    call_command("rotate_master_key", stdout=StringIO())
    assert TenantKey.objects.get(tenant=tenant).master_kid == "k9"
    call_command("rotate_tenant_key", tenant.slug, stdout=StringIO())
    assert TenantKey.objects.get(tenant=tenant).version == 2
    with pytest.raises(CommandError):
        call_command("shred_tenant_content", tenant.slug)  # needs --yes
    call_command("shred_tenant_content", tenant.slug, "--yes", stdout=StringIO())
    assert not ContentRecord.objects.exists() and not TenantKey.objects.exists()


@pytest.mark.django_db
def test_the_celery_tasks_drain_and_purge(redis_client):
    from gateway.contentlog import tasks

    tenant = opted_in()
    store.enqueue_content("r-task", tenant.pk, "p", "r")
    assert tasks.drain_content() == 1
    ContentRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert tasks.purge_expired() == 1


@pytest.mark.django_db(transaction=True)
def test_concurrent_drains_lose_and_duplicate_nothing(redis_client):
    """Four drains race over one backlog while more items arrive: each request lands once."""
    import threading

    from django.db import connection

    tenant = opted_in()
    for i in range(150):
        store.enqueue_content(f"r{i}", tenant.pk, "p", "r", opted_in=True)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(30):
                store.drain(batch=7)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(150, 200):
        store.enqueue_content(f"r{i}", tenant.pk, "p", "r", opted_in=True)
    for t in threads:
        t.join()
    store.drain_all()
    assert not errors
    ids = list(ContentRecord.objects.values_list("request_id", flat=True))
    assert sorted(ids) == sorted(f"r{i}" for i in range(200))
    assert redis_client.llen(store.pending_key()) == 0
    assert redis_client.llen(store.processing_key()) == 0
