"""Fairness as an SLO (metering.fairness): service in VTC units against weighted shares over a
sliding window, the largest service difference between backlogged tenants, queue wait and TTFT
p95 against the uncontended TTFT; exported as igw_fair_*. Against the benchmark's own measure
on real processes: tests/test_bench_fairness.py."""

from __future__ import annotations

import json

import pytest

from infra.redis_conn import get_redis
from metering import fairness, metrics, writer
from metering.keys import pending_key, pools_key
from tests.factories import make_tenant
from tests.prom import value

pytestmark = pytest.mark.django_db
T0 = 1_780_000_000.0


def test_spread_counts_prompt_at_first_token_and_output_evenly(settings):
    settings.WFQ_INPUT_PRICE, settings.WFQ_OUTPUT_PRICE = 1.0, 2.0
    parts = list(fairness.spread(100, 50, (T0 + 0.5) * 1000, (T0 + 2.5) * 1000))
    assert parts[0] == (int(T0), 100.0)
    by_second: dict[int, float] = {}
    for second, units in parts[1:]:
        by_second[second] = by_second.get(second, 0) + units
    assert by_second == pytest.approx({int(T0): 25.0, int(T0) + 1: 50.0, int(T0) + 2: 25.0})


def record(rid: str, tenant: int, prompt: int, output: int, first: float, end: float,
           wait_ms: int = 0, pool: str = "fair-pool") -> bytes:
    admitted = first - 1
    return json.dumps({
        "request_id": rid, "tenant_id": tenant, "key_id": None, "model": "m", "pool": pool,
        "prompt_tokens": prompt, "cached_tokens": 0, "completion_tokens": output,
        "queue_wait_ms": wait_ms, "ttft_ms": round((first - admitted) * 1000),
        "total_ms": 1, "status": "ok", "admitted_at_ms": admitted * 1000,
        "first_token_at_ms": first * 1000, "settled_at_ms": end * 1000}).encode()


def test_shares_ratio_and_max_diff_over_the_window(redis_client, settings):
    settings.WFQ_INPUT_PRICE, settings.WFQ_OUTPUT_PRICE = 1.0, 2.0
    r = get_redis()
    a, b, c = (make_tenant(f"fair-{n}") for n in "abc")
    r.hset(fairness.weights_key("fair-pool"), mapping={str(a.pk): 3, str(b.pk): 1, str(c.pk): 1})
    r.zadd(fairness.heads_key("fair-pool"), {str(a.pk): 1, str(b.pk): 2})  # c is idle now
    r.sadd(pools_key(), "fair-pool")
    rows = [record("r1", a.pk, 100, 100, T0 + 1, T0 + 2),  # 300 units
            record("r2", b.pk, 50, 25, T0 + 1, T0 + 2, wait_ms=500),  # 100 units
            record("r3", c.pk, 50, 25, T0 + 3, T0 + 4),  # 100 units
            record("old", a.pk, 10_000, 0, T0 - 100, T0 - 99)]  # before the window
    r.rpush(pending_key("fair-pool"), *rows)
    writer.flush()
    pf = fairness.figures(r, "fair-pool", since=T0, until=T0 + 10)
    fa, fb, fc = (pf.tenants[str(t.pk)] for t in (a, b, c))
    assert pf.total_service == pytest.approx(500)
    assert (fa.service_share, fb.service_share, fc.service_share) == pytest.approx((.6, .2, .2))
    assert (fa.weighted_share, fb.weighted_share) == pytest.approx((.6, .2))
    assert fa.share_ratio == pytest.approx(1.0) and fb.backlogged and not fc.backlogged
    assert pf.max_service_diff == pytest.approx(0.0)  # a: 300/3 = b: 100/1
    assert fb.queue_wait_p95_s == pytest.approx(0.5)
    assert fa.ttft_p95_s == pytest.approx(1.0)
    assert fa.uncontended_ttft_p95_s is not None and fa.ttft_slowdown is not None
    assert fb.uncontended_ttft_p95_s is None  # it always waited: no calm sample


def test_gauges_are_exported_per_pool_and_tenant(redis_client, settings):
    settings.FAIRNESS_WINDOW_SECONDS = 60
    import time

    r = get_redis()
    t = make_tenant("fair-x")
    now = time.time()
    r.sadd(pools_key(), "fair-pool")
    r.hset(fairness.weights_key("fair-pool"), str(t.pk), 1)
    r.zadd(fairness.heads_key("fair-pool"), {str(t.pk): 1})
    r.rpush(pending_key("fair-pool"), record("r9", t.pk, 10, 5, now - 2, now - 1))
    writer.flush()
    text = metrics.render(r)
    assert value(text, "igw_fair_service_share", pool="fair-pool", tenant="fair-x") == 1.0
    assert value(text, "igw_fair_share_ratio", pool="fair-pool", tenant="fair-x") == 1.0
    assert value(text, "igw_fair_backlogged", pool="fair-pool", tenant="fair-x") == 1.0
    assert value(text, "igw_fair_max_service_diff", pool="fair-pool") == 0.0
    assert value(text, "igw_fair_service_units", pool="fair-pool", tenant="fair-x") > 0


def test_admin_fairness_page_and_live_data(admin_client, client, redis_client, settings):
    import time

    from django.contrib.auth.models import Permission

    from tests.worlds import make_user

    r = get_redis()
    t = make_tenant("fair-admin")
    now = time.time()
    r.sadd(pools_key(), "fair-pool")
    r.hset(fairness.weights_key("fair-pool"), str(t.pk), 2)
    r.zadd(fairness.heads_key("fair-pool"), {str(t.pk): 1})
    r.rpush(pending_key("fair-pool"), record("r-adm", t.pk, 10, 5, now - 2, now - 1))
    writer.flush()
    page = admin_client.get("/admin/metering/usagerecord/fairness/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'data-pool="fair-pool"' in html and 'data-tenant="fair-admin"' in html
    assert "canvas" in html and "metering/fairness.js" in html
    data = admin_client.get("/admin/metering/usagerecord/fairness/data/").json()
    pool = next(p for p in data["pools"] if p["pool"] == "fair-pool")
    row = next(x for x in pool["tenants"] if x["tenant"] == "fair-admin")
    assert row["service_share"] == 1.0 and row["weight"] == 2.0 and row["backlogged"]
    # Staff without the usage-record view permission are refused; with it, they see it.
    staff = make_user("fair-staff", is_staff=True)
    client.force_login(staff)
    assert client.get("/admin/metering/usagerecord/fairness/data/").status_code == 403
    staff.user_permissions.add(Permission.objects.get(codename="view_usagerecord"))
    assert client.get("/admin/metering/usagerecord/fairness/data/").status_code == 200
    client.logout()
    assert client.get("/admin/metering/usagerecord/fairness/").status_code == 302  # sign in
