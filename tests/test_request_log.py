"""The tenants' request log (metering.requestlog): written by the usage writer from usage
records and queued refusals, purged past its retention, listed by the management API with
filters, cost and the member's own-keys narrowing. Live: tests/test_observability_live.py."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from infra.redis_conn import get_async_redis, get_redis
from metering import requestlog, writer
from metering.billing.models import Price
from metering.keys import pending_key, pools_key, refusals_pending_key
from metering.models import RequestLogEntry, UsageRecord
from tenants.auth import clear_cache
from tests.procs import arun
from tests.worlds import build_world

pytestmark = pytest.mark.django_db
NOW_MS = 1_780_000_000_000


@pytest.fixture
def world(redis_client):
    clear_cache()
    return build_world()


def usage_json(rid: str, tenant_id: int, key_id: int | None, **extra: object) -> bytes:
    data = {"request_id": rid, "tenant_id": tenant_id, "key_id": key_id, "model": "sim-small",
            "pool": "shared-small", "prompt_tokens": 1_000_000, "cached_tokens": 0,
            "completion_tokens": 500_000, "queue_wait_ms": 3, "ttft_ms": 40, "total_ms": 90,
            "status": "ok", "stream": True, "admitted_at_ms": NOW_MS - 90,
            "settled_at_ms": NOW_MS, **extra}
    return json.dumps(data).encode()


def refusal(rid: str, tenant_id: int, key_id: int | None, **extra: object) -> bytes:
    fields: dict = {"request_id": rid, "tenant_id": tenant_id, "key_id": key_id,
                    "model": "sim-small", "pool": "shared-small", "http_status": 429,
                    "error_code": "rate_limit_exceeded", "end_user": "u-9", "prompt_tokens": 12,
                    **extra}
    return requestlog.refusal_json(**fields)


def test_writer_logs_settled_and_refused_requests_once(world):
    r = get_redis()
    t, owner_key = world.tenant, world.keys["owner"]
    r.sadd(pools_key(), "shared-small")
    r.rpush(pending_key("shared-small"), usage_json("req-a", t.pk, owner_key.pk,
                                                    end_user="alice", project_id=7))
    r.rpush(refusals_pending_key(), refusal("req-b", t.pk, owner_key.pk))
    writer.flush()
    writer.flush()  # nothing twice
    a, b = (RequestLogEntry.objects.get(request_id=rid) for rid in ("req-a", "req-b"))
    assert (a.status, a.http_status, a.end_user, a.project_id, a.ttft_ms, a.total_ms) == (
        "ok", 200, "alice", 7, 40, 90)
    assert UsageRecord.objects.filter(request_id="req-a").exists()
    assert (b.status, b.http_status, b.error_code, b.end_user, b.prompt_tokens) == (
        "refused", 429, "rate_limit_exceeded", "u-9", 12)
    assert not UsageRecord.objects.filter(request_id="req-b").exists()  # a refusal is no bill
    assert RequestLogEntry.objects.count() == 2
    assert r.llen(refusals_pending_key()) == 0


def test_an_unreadable_refusal_is_dropped_not_blocking(world):
    r = get_redis()
    r.rpush(refusals_pending_key(), b"{not json", refusal("req-ok", world.tenant.pk, None))
    assert requestlog.flush_refusals(r) == 1
    assert list(RequestLogEntry.objects.values_list("request_id", flat=True)) == ["req-ok"]


def test_pending_refusals_are_capped(settings, redis_client):
    settings.REQUEST_LOG_MAX_PENDING = 3

    async def push() -> None:
        client = get_async_redis()
        for i in range(5):
            await requestlog.arecord_refusal(client, refusal(f"req-{i}", 1, None))

    arun(push())
    kept = [json.loads(x)["request_id"] for x in redis_client.lrange(refusals_pending_key(), 0, -1)]
    assert kept == ["req-2", "req-3", "req-4"]  # the newest


def test_purge_keeps_the_retention(world, settings):
    settings.REQUEST_LOG_RETENTION_DAYS = 7
    now = datetime(2026, 12, 1, tzinfo=UTC)
    for rid, age in (("old", timedelta(days=8)), ("new", timedelta(days=6))):
        RequestLogEntry.objects.create(request_id=rid, at=now - age, tenant=world.tenant,
                                       model_name="sim-small", status="ok")
    assert requestlog.purge(now) == 1
    assert list(RequestLogEntry.objects.values_list("request_id", flat=True)) == ["new"]


def _entries(world):
    t = world.tenant
    at = datetime(2026, 11, 30, 12, tzinfo=UTC)
    rows = [("r-owner-ok", world.keys["owner"], "ok", "", "alice"),
            ("r-owner-429", world.keys["owner"], "refused", "rate_limit_exceeded", "bob"),
            ("r-member-429", world.keys["member"], "refused", "rate_limit_exceeded", "alice")]
    for i, (rid, key, status, code, user) in enumerate(rows):
        RequestLogEntry.objects.create(
            request_id=rid, at=at + timedelta(seconds=i), tenant=t, api_key=key,
            model_name="sim-small", status=status, error_code=code, end_user=user,
            http_status=200 if status == "ok" else 429, prompt_tokens=1_000_000,
            completion_tokens=500_000 if status == "ok" else 0)
    RequestLogEntry.objects.create(request_id="r-other", at=at, tenant=world.other,
                                   api_key=world.keys["other"], model_name="sim-small",
                                   status="ok")


def _get(world, who: str, query: str = "") -> list[dict]:
    client = APIClient()
    client.force_authenticate(world.users[who])
    response = client.get(f"/api/tenants/acme/requests/{query}")
    assert response.status_code == 200, response.content
    return response.json()["results"]


def test_api_lists_filters_and_narrows_to_a_members_keys(world):
    _entries(world)
    assert [r["request_id"] for r in _get(world, "owner")] == [
        "r-member-429", "r-owner-429", "r-owner-ok"]  # newest first, no other tenant
    assert [r["request_id"] for r in _get(world, "member")] == ["r-member-429"]
    assert {r["request_id"] for r in _get(world, "owner", "?status=refused")} == {
        "r-member-429", "r-owner-429"}
    assert [r["request_id"] for r in _get(world, "owner", "?end_user=bob")] == ["r-owner-429"]
    assert [r["request_id"] for r in _get(world, "owner", "?code=rate_limit_exceeded"
                                          f"&key={world.keys['owner'].pk}")] == ["r-owner-429"]
    row = _get(world, "billing", "?status=ok")[0]
    assert "prompt" not in json.dumps(row).replace("prompt_tokens", "")  # counts, no content


def test_api_costs_each_request_at_its_price(world):
    _entries(world)
    Price.objects.create(model_name="sim-small", currency="USD", input_per_mtok=Decimal("1"),
                         cached_input_per_mtok=Decimal("0.5"), output_per_mtok=Decimal("4"),
                         effective_from=datetime(2026, 1, 1, tzinfo=UTC))
    ok = _get(world, "owner", "?status=ok")[0]
    assert (Decimal(ok["cost"]), ok["currency"]) == (Decimal(3), "USD")  # 1 + 0.5 x 4
    refused = _get(world, "owner", "?status=refused")[0]
    assert Decimal(refused["cost"]) == 0  # never admitted, so never charged


def test_api_refuses_bad_filters(world):
    client = APIClient()
    client.force_authenticate(world.users["owner"])
    for query, param in (("?status=nope", "status"), ("?project=x", "project"),
                         ("?key=x", "key")):
        response = client.get(f"/api/tenants/acme/requests/{query}")
        assert response.status_code == 400, query
        assert response.json()["error"]["param"] == param, query


def test_the_endpoint_is_in_the_openapi_document(world):
    client = APIClient()
    schema = client.get("/api/schema/?format=json").json()
    assert "/api/tenants/{tenant}/requests/" in schema["paths"]


def test_portal_page_filters_and_shows_a_member_only_their_keys(world, client):
    from django.utils import timezone

    _entries(world)
    RequestLogEntry.objects.update(at=timezone.now() - timedelta(minutes=5))
    client.force_login(world.users["owner"])
    page = client.get("/portal/requests/").content.decode()
    assert all(f'data-request="{rid}"' in page
               for rid in ("r-owner-ok", "r-owner-429", "r-member-429"))
    assert 'data-request="r-other"' not in page and "rate_limit_exceeded" in page
    refused = client.get("/portal/requests/?status=refused&end_user=bob").content.decode()
    assert 'data-request="r-owner-429"' in refused and 'data-request="r-owner-ok"' not in refused
    assert client.get("/portal/requests/?status=bogus&key=x").status_code == 200  # ignored
    client.force_login(world.users["member"])
    mine = client.get("/portal/requests/").content.decode()
    assert 'data-request="r-member-429"' in mine and 'data-request="r-owner-ok"' not in mine


def test_portal_names_and_filters_projects(world, client):
    from django.utils import timezone

    from tenants.models import Project

    project = Project.objects.create(tenant=world.tenant, name="Mobile app", slug="mobile")
    at = timezone.now() - timedelta(minutes=1)
    for rid, pid in (("r-in-project", project.pk), ("r-no-project", None)):
        RequestLogEntry.objects.create(request_id=rid, at=at, tenant=world.tenant,
                                       api_key=world.keys["owner"], project_id=pid,
                                       model_name="sim-small", status="ok")
    client.force_login(world.users["owner"])
    page = client.get("/portal/requests/").content.decode()
    assert "Mobile app" in page and 'data-request="r-no-project"' in page
    only = client.get(f"/portal/requests/?project={project.pk}").content.decode()
    assert 'data-request="r-in-project"' in only and 'data-request="r-no-project"' not in only
    api = APIClient()
    api.force_authenticate(world.users["owner"])
    rows = api.get(f"/api/tenants/acme/requests/?project={project.pk}").json()["results"]
    assert [r["request_id"] for r in rows] == ["r-in-project"]
