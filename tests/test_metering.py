"""Metering: the batch writer loses and duplicates nothing; rollups add up; admin never counts."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from infra import leased_queue
from infra.redis_conn import tenant_key
from metering import rollups, writer
from metering.admin import CappedCountPaginator
from metering.keys import pools_key
from metering.models import UsageRecord, UsageRollup
from metering.tasks import flush_usage, rollup_usage
from tests.prom import samples, value

pytestmark = pytest.mark.django_db
T0 = datetime(2026, 11, 30, 9, 15, tzinfo=UTC)


def record(rid: str, *, tenant: int = 1, key: int = 10, model: str = "sim-small",
           prompt: int = 5, completion: int = 3, at: datetime = T0, status: str = "ok") -> dict:
    return {
        "request_id": rid, "tenant_id": tenant, "key_id": key, "model": model, "pool": "p1",
        "prompt_tokens": prompt, "cached_tokens": 1, "completion_tokens": completion,
        "queue_wait_ms": 4, "ttft_ms": 20.4, "total_ms": 90, "status": status,
        "finish_reason": "stop", "error_code": None, "stream": True,
        "admitted_at_ms": round((at - timedelta(seconds=1)).timestamp() * 1000),
        "settled_at_ms": round(at.timestamp() * 1000),
    }


def hour_of_ms(ms: int) -> datetime:
    return writer.hour_of(datetime.fromtimestamp(ms / 1000, UTC))


POOL = "p"  # settlement pushes onto the request's pool's queue; the writer walks the pools


def push(redis_client, *records: dict) -> None:
    redis_client.sadd(pools_key(), POOL)
    redis_client.rpush(writer.pending_key(POOL), *(json.dumps(r) for r in records))


def test_flush_writes_every_field_and_empties_redis(redis_client) -> None:
    push(redis_client, record("a"), record("b", prompt=7))
    result = writer.flush()
    assert result is not None and (result.claimed, result.inserted) == (2, 2)
    a = UsageRecord.objects.get(request_id="a")
    assert (a.tenant_id, a.api_key_id, a.model_name, a.pool_name) == (1, 10, "sim-small", "p1")
    assert (a.prompt_tokens, a.cached_tokens, a.completion_tokens) == (5, 1, 3)
    assert (a.queue_wait_ms, a.ttft_ms, a.total_ms, a.status) == (4, 20, 90, "ok")
    assert a.finished_at == T0 and a.started_at == T0 - timedelta(seconds=1)
    assert redis_client.llen(writer.pending_key(POOL)) == 0
    assert redis_client.llen(writer.processing_key(POOL)) == 0


def test_records_hold_no_content_fields() -> None:
    names = {f.name for f in UsageRecord._meta.get_fields()}
    assert not names & {"prompt", "messages", "text", "content", "response", "completion"}


def test_same_record_twice_is_written_once(redis_client) -> None:
    push(redis_client, record("dup"), record("dup"))
    writer.flush()
    push(redis_client, record("dup", prompt=99))
    writer.flush()
    assert UsageRecord.objects.filter(request_id="dup").count() == 1
    assert UsageRecord.objects.get(request_id="dup").prompt_tokens == 5


def test_batch_left_by_a_crashed_writer_is_written_first(redis_client) -> None:
    push(redis_client, *(record(f"r{i}") for i in range(5)))
    # A writer claimed a batch and died before committing: its batch sits in processing.
    redis_client.set(writer.lease_key(POOL), "dead-writer", px=10)
    redis_client.lmove(writer.pending_key(POOL), writer.processing_key(POOL), "LEFT", "RIGHT")
    redis_client.lmove(writer.pending_key(POOL), writer.processing_key(POOL), "LEFT", "RIGHT")
    redis_client.delete(writer.lease_key(POOL))  # its lease ran out
    writer.flush(batch_size=2)
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == [
        f"r{i}" for i in range(5)]
    assert redis_client.llen(writer.processing_key(POOL)) == 0


def test_crash_after_commit_before_release_duplicates_nothing(redis_client, monkeypatch) -> None:
    push(redis_client, record("x"), record("y"))
    real = leased_queue._RELEASE
    monkeypatch.setattr(leased_queue, "_RELEASE", "return 0")  # the release never happens
    writer.flush()
    assert redis_client.llen(writer.processing_key(POOL)) == 2  # still held in Redis
    monkeypatch.setattr(leased_queue, "_RELEASE", real)
    writer.flush()
    assert UsageRecord.objects.count() == 2
    assert redis_client.llen(writer.processing_key(POOL)) == 0


def test_a_writer_without_the_lease_claims_nothing(redis_client) -> None:
    push(redis_client, record("held"))
    redis_client.set(writer.lease_key(POOL), "someone-else", px=60_000)
    assert writer.flush() is None
    claimed = redis_client.eval(leased_queue._CLAIM, 3, writer.pending_key(POOL),
                                writer.processing_key(POOL), writer.lease_key(POOL),
                                "not-the-token", 10)
    assert claimed is None and redis_client.llen(writer.pending_key(POOL)) == 1


def test_unreadable_records_are_kept_aside_not_lost(redis_client) -> None:
    redis_client.rpush(writer.pending_key(POOL), b"{oops", json.dumps({"request_id": "no-tenant"}))
    push(redis_client, record("good"))
    result = writer.flush()
    assert result is not None and result.rejected == 2 and result.inserted == 1
    assert redis_client.llen(writer.dead_key()) == 2


def test_rollups_add_up_per_hour_tenant_key_model(redis_client) -> None:
    rng = random.Random(4)
    recs = [
        record(f"q{i}", tenant=rng.choice([1, 2]), key=rng.choice([10, 11]),
               model=rng.choice(["a", "b"]), prompt=rng.randint(0, 50),
               completion=rng.randint(0, 50), at=T0 + timedelta(minutes=rng.randint(0, 150)),
               status=rng.choice(["ok", "ok", "cancelled"]))
        for i in range(200)
    ]
    push(redis_client, *recs)
    rollup_usage()
    assert UsageRollup.objects.values("hour").distinct().count() == 3  # 09:xx, 10:xx, 11:xx
    for r in UsageRollup.objects.all():
        mine = [x for x in recs if x["tenant_id"] == r.tenant_id and x["key_id"] == r.api_key_id
                and x["model"] == r.model_name
                and hour_of_ms(x["settled_at_ms"]) == r.hour]
        assert r.requests == len(mine)
        assert r.prompt_tokens == sum(x["prompt_tokens"] for x in mine)
        assert r.completion_tokens == sum(x["completion_tokens"] for x in mine)
        assert r.errors == sum(x["status"] != "ok" for x in mine)
    assert sum(UsageRollup.objects.values_list("completion_tokens", flat=True)) == sum(
        x["completion_tokens"] for x in recs)
    assert redis_client.hlen(writer.dirty_hours_key()) == 0


def test_rollup_is_idempotent_and_takes_late_records(redis_client) -> None:
    push(redis_client, record("early", completion=3))
    rollup_usage()
    rollup_usage()
    push(redis_client, record("late", completion=4, at=T0 + timedelta(minutes=30)))
    rollup_usage()
    row = UsageRollup.objects.get()
    assert (row.requests, row.completion_tokens) == (2, 7)


def test_rollup_rows_per_end_user_replace_the_hours_old_rows(redis_client) -> None:
    hour = writer.hour_of(T0)
    # A row as written before end users were part of the key: it must not be counted again.
    UsageRollup.objects.create(hour=hour, tenant_id=1, api_key_id=10, model_name="sim-small",
                               requests=9, completion_tokens=99)
    push(redis_client, {**record("a", completion=3), "end_user": "alice"},
         {**record("b", completion=4), "end_user": "alice"},
         {**record("c", completion=5), "end_user": "bob"}, record("d", completion=6))
    rollup_usage()
    rows = {r.end_user: (r.requests, r.completion_tokens) for r in UsageRollup.objects.all()}
    assert rows == {"alice": (2, 7), "bob": (1, 5), "": (1, 6)}


def test_an_hour_marked_again_during_its_rollup_stays_marked(redis_client, monkeypatch) -> None:
    push(redis_client, record("a"))
    flush_usage()
    real = rollups.rollup_hour

    def rollup_while_a_writer_marks_again(hour: datetime) -> int:
        n = real(hour)
        redis_client.hincrby(writer.dirty_hours_key(), hour.isoformat(), 1)
        return n

    monkeypatch.setattr(rollups, "rollup_hour", rollup_while_a_writer_marks_again)
    rollups.rollup_dirty()
    assert redis_client.hlen(writer.dirty_hours_key()) == 1


def test_paginator_never_counts_the_whole_table(redis_client) -> None:
    push(redis_client, *(record(f"p{i}") for i in range(30)))
    flush_usage()
    CappedCountPaginator.CAP = 10
    try:
        paginator = CappedCountPaginator(UsageRecord.objects.order_by("-id"), 5)
        with CaptureQueriesContext(connection) as ctx:
            assert paginator.count == 10
            assert len(paginator.page(2).object_list) == 5
        assert all("LIMIT" in q["sql"] for q in ctx.captured_queries)
    finally:
        CappedCountPaginator.CAP = 10_000


def test_admin_changelists_render(admin_client, redis_client) -> None:
    push(redis_client, record("shown"))
    rollup_usage()
    page = admin_client.get("/admin/metering/usagerecord/")
    shown = UsageRecord.objects.get(request_id="shown")
    # The list fits a 1366 px screen without the request id; each row links to its page.
    assert page.status_code == 200
    assert f"/admin/metering/usagerecord/{shown.pk}/change/".encode() in page.content
    assert admin_client.get("/admin/metering/usagerollup/").status_code == 200


def test_flush_feeds_the_prometheus_counters(redis_client) -> None:
    from metering import metrics
    from tests.factories import make_tenant

    tenant = make_tenant("metered")
    push(redis_client, record("m1", tenant=tenant.pk, prompt=5, completion=3),
         record("m2", tenant=tenant.pk, prompt=7, completion=4, status="cancelled"))
    redis_client.set(tenant_key("streams", tenant.pk, "tenant"), 2)
    redis_client.hincrby(metrics.rejected_key(), f"{tenant.pk}|sim-small|input_tokens", 3)
    flush_usage()
    got = samples(metrics.render())
    labels = {"tenant": "metered", "model": "sim-small"}

    def at(name: str, **more: str) -> float | None:
        return got.get((name, frozenset({**labels, **more}.items())))

    assert at("igw_requests_total", status="ok") == 1
    assert at("igw_requests_total", status="cancelled") == 1
    assert at("igw_tokens_total", direction="in") == 12
    assert at("igw_tokens_total", direction="out") == 7
    # Both records had a 20.4 ms TTFT: in the 0.05 s bucket and every one above it.
    assert at("igw_time_to_first_token_seconds_bucket", le="0.05") == 2
    assert at("igw_time_to_first_token_seconds_bucket", le="0.01") is None  # not an edge
    assert at("igw_time_to_first_token_seconds_count") == 2
    assert at("igw_time_to_first_token_seconds_sum") == pytest.approx(0.04)  # 20 ms each, as stored
    assert at("igw_queue_wait_seconds_bucket", le="+Inf") == 2
    assert at("igw_rate_limited_total", reason="input_tokens") == 3
    assert got[("igw_active_streams", frozenset({"tenant": "metered"}.items()))] == 2


def test_a_scrape_reads_by_name_and_never_scans_the_keyspace(redis_client, monkeypatch) -> None:
    """The cost of a scrape must not grow with the keys Redis holds (streams, queues, buckets):
    every read names its keys (the series index, the tenants' counters, the pools set)."""
    import redis as redis_py

    from metering import metrics
    from tests.factories import make_tenant

    tenant = make_tenant("scanned")
    redis_client.set(tenant_key("streams", tenant.pk, "tenant"), 1)
    push(redis_client, record("s1", tenant=tenant.pk))
    flush_usage()
    sent: list[str] = []
    for cls in (redis_py.Redis, redis_py.client.Pipeline):
        real = cls.execute_command

        def spy(self, *args, _real=real, **kwargs):
            sent.append(str(args[0]).upper())
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "execute_command", spy)
    text = metrics.render()
    assert sent and not {"SCAN", "KEYS"} & set(sent), sent
    assert value(text, "igw_active_streams", tenant="scanned") == 1
