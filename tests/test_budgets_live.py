"""Budgets against the running system: two uvicorn gateways and a Celery pool worker racing the
last dollar of a key budget and of a tenant budget (B1 in serving/lua/admit.lua), and settlement
of streams that finish, are cancelled or lose their client, to the exact cost (B3).

Prices are 1,000 USD per million tokens (0.001 USD a token), so a budget of cents holds a
handful of requests and a leak of a single token would show.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

import httpx
import pytest
from django.utils import timezone

from catalog.models import Pool
from metering.billing.models import Price
from serving.budgets import UnitPrices, counter_key
from serving.tokenization import load_tokenizer
from tenants.budgets import rule_of, window
from tenants.models import Budget
from tests import procs, rkeys
from tests.factories import make_key, make_model, make_tenant, open_quota
from tests.worlds import price

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

POOL, MODEL = "budget-pool", "sim-budget"
ENV = {"WORKER_HEARTBEAT_SECONDS": "0.2", "WORKER_DEAD_AFTER_SECONDS": "2"}
PER_MTOK = Decimal(1000)
PRICES = UnitPrices.per_mtok("USD", PER_MTOK, PER_MTOK, PER_MTOK)
HELLO = [{"role": "user", "content": "Say hello."}]


def ensure_rows() -> None:
    model = make_model(MODEL)
    Pool.objects.get_or_create(name=POOL, defaults={
        "model": model, "backend_settings": {"decode_tokens_per_s": 400.0},
        "max_sequences": 64})
    if not Price.objects.filter(model_name=MODEL).exists():
        start = timezone.now().replace(year=2020, minute=0, second=0, microsecond=0)
        price(MODEL, start, str(PER_MTOK), str(PER_MTOK), str(PER_MTOK))


@pytest.fixture(scope="module")
def system(live_system) -> dict[str, Any]:
    sys_ = live_system(pool=POOL, worker_ids=["budget-w1"], env=ENV, prepare=ensure_rows)
    second, url2 = procs.start_uvicorn(env=ENV)
    with second:  # stopped however the module ends
        procs.wait_for_http(url2 + "/healthz", second)
        yield {"urls": [sys_["url"], url2], "worker": sys_["worker"]}


@pytest.fixture
def live(system, redis_client) -> dict[str, Any]:
    ensure_rows()
    procs.wait_for_worker(redis_client, POOL, "budget-w1", system["worker"], timeout=10)
    return system


def reservation(max_tokens: int) -> int:
    prompt = len(load_tokenizer(None).apply_chat_template(HELLO))
    return PRICES.micro_cost(prompt, 0, max_tokens)


def spent(redis_client, budget: Budget) -> int:
    rule = rule_of(budget)
    label = window(rule.period, timezone.now()).label
    return int(redis_client.get(counter_key(budget.tenant_id, rule, label)) or 0)


async def _fire(urls: list[str], plains: list[str], n: int, body: dict[str, Any]
                ) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        return await asyncio.gather(*(
            http.post(urls[i % 2] + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {plains[i % len(plains)]}"})
            for i in range(n)))


def records(redis_client, tenant_id: int) -> list[dict[str, Any]]:
    return [r for r in rkeys.usage_records(redis_client) if r["tenant_id"] == tenant_id]


def _race(live, redis_client, budget: Budget, plains: list[str]) -> tuple[int, int]:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "ignore_eos": True}
    answers = procs.arun(_fire(live["urls"], plains, 200, body))
    ok = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    for r in refused:
        error = r.json()["error"]
        assert r.status_code == 429 and error["code"] == "insufficient_quota", r.text
        assert error["type"] == "insufficient_quota" and int(r.headers["retry-after"]) > 0
        assert "resets at" in error["message"]
    procs.wait_until(lambda: len(records(redis_client, budget.tenant_id)) == len(ok), 30,
                     "every admitted request settled")
    cost = sum(PRICES.micro_cost(r["prompt_tokens"], r["cached_tokens"],
                                 r["completion_tokens"])
               for r in records(redis_client, budget.tenant_id))
    limit = int(budget.limit * 1_000_000)
    print(f"budget {budget.limit} USD, spend {Decimal(cost) / 1_000_000} USD, "
          f"{len(ok)} admitted, {len(refused)} refused (429 insufficient_quota)")
    assert cost == spent(redis_client, budget) <= limit  # zero overspend, counter = records
    # Each request costs exactly its reservation (ignore_eos), so the budget admits exactly as
    # many as fit: no more (no leak) and no fewer (nothing reserved twice or left behind).
    assert len(ok) == limit // reservation(4)
    return len(ok), len(refused)


def test_two_gateways_race_the_last_dollar_of_a_key_budget(live, redis_client) -> None:
    tenant = make_tenant(**open_quota(streams=500))
    key, plain = make_key(tenant)
    budget = Budget.objects.create(tenant=tenant, level="key", api_key=key,
                                   limit=Decimal("0.25"), period="month")
    ok, refused = _race(live, redis_client, budget, [plain])
    assert ok > 0 and refused > 100


def test_two_gateways_and_two_keys_race_a_tenant_budget(live, redis_client) -> None:
    tenant = make_tenant(**open_quota(streams=500))
    plains = [make_key(tenant, name=f"k{i}")[1] for i in range(2)]
    budget = Budget.objects.create(tenant=tenant, level="tenant", limit=Decimal("0.30"),
                                   period="day")
    ok, refused = _race(live, redis_client, budget, plains)
    assert ok > 0 and refused > 100


async def _streams(url: str, plain: str, n: int, cut_after: int | None) -> None:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 60, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(timeout=60) as http:
        async def one() -> None:
            async with http.stream("POST", url + "/v1/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {plain}"}) as resp:
                assert resp.status_code == 200
                seen = 0
                async for line in resp.aiter_lines():
                    seen += line.startswith("data: {")
                    if cut_after is not None and seen >= cut_after:
                        return  # the client leaves mid-stream
        await asyncio.gather(*(one() for _ in range(n)))


def test_disconnects_settle_to_delivered_tokens_times_price(live, redis_client) -> None:
    tenant = make_tenant(**open_quota(streams=500))
    key, plain = make_key(tenant)
    budget = Budget.objects.create(tenant=tenant, level="key", api_key=key,
                                   limit=Decimal("100"), period="month")
    procs.arun(_streams(live["urls"][0], plain, 6, cut_after=3))
    procs.arun(_streams(live["urls"][1], plain, 4, cut_after=None))
    procs.wait_until(lambda: len(records(redis_client, tenant.id)) == 10, 30,
                     "every stream settled")
    got = records(redis_client, tenant.id)
    assert sorted(r["status"] for r in got).count("cancelled") >= 1
    assert any(0 < r["completion_tokens"] < 60 for r in got)
    cost = sum(PRICES.micro_cost(r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"])
               for r in got)
    assert spent(redis_client, budget) == cost  # to the micro-unit, reservations all returned


def test_end_user_budgets_by_body_field_and_by_the_tenants_header(live, redis_client) -> None:
    """A tenant's default end-user budget binds each end user apart (body `user` or
    `safety_identifier`); a tenant that names a header identifies them by it instead."""
    tenant = make_tenant(**open_quota(streams=500))
    _, plain = make_key(tenant)
    each = reservation(4) * 2  # room for two requests per end user and day
    Budget.objects.create(tenant=tenant, level="end_user", metric="money",
                          limit=Decimal(each) / 1_000_000, period="day")
    url = live["urls"][0] + "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {plain}"}

    def post(**extra: Any) -> httpx.Response:
        headers = {**auth, **extra.pop("headers", {})}
        return httpx.post(url, timeout=30, headers=headers, json={
            "model": MODEL, "messages": HELLO, "max_tokens": 4, "ignore_eos": True, **extra})

    assert [post(user="alice").status_code for _ in range(3)] == [200, 200, 429]
    refused = post(safety_identifier="alice").json()["error"]
    assert refused["code"] == "insufficient_quota" and "end user budget" in refused["message"]
    assert post(user="bob").status_code == 200
    assert post().status_code == 200  # no end user named: no end-user budget applies
    tenant.end_user_header = "x-end-user"
    tenant.save()
    assert post(user="bob", headers={"x-end-user": "carol"}).status_code == 200
    assert post(user="carol").status_code == 200  # the body no longer names the end user
    assert [post(headers={"x-end-user": "carol"}).status_code for _ in range(2)] == [200, 429]
