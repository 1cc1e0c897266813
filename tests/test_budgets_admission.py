"""Budgets reserved in admit.lua and settled exactly (serving.budgets; B1-B3 in the scripts),
on real Redis, through the async path production uses (``admit_async``, ``settle_async``)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from infra.redis_conn import get_async_redis
from serving import admission, budgets, settlement
from serving.admission import AdmissionLimits, Admitted, Reason, Rejected, ScopeLimits
from tenants.budgets import MICRO, BudgetRule, KeyBudgets, end_user_of, window

T0 = datetime(2026, 12, 31, 23, 59, 0, tzinfo=UTC).timestamp()  # a minute before a new month
PRICES = budgets.UnitPrices.per_mtok("USD", Decimal("2"), Decimal("0.5"), Decimal("8"))
LIMITS = AdmissionLimits(tenant=ScopeLimits(), total_deadline_s=60)


def rule(level: str, limit_usd: str, period: str = "month", ident: str = "1",
         metric: str = "money") -> BudgetRule:
    limit = int(Decimal(limit_usd) * MICRO) if metric == "money" else int(limit_usd)
    return BudgetRule(1, level, ident, metric, limit, "USD", period)


async def admit(rid: str, rules: list[BudgetRule], *, prompt: int = 1000, out: int = 500,
                now: float = T0) -> Admitted | Rejected:
    reservation = budgets.reserve(1, rules, PRICES, prompt, out, now)
    return await admission.admit_async(
        request_id=rid, tenant_id=1, key_id=11, pool="p", model="m", prompt_tokens=prompt,
        max_output_tokens=out, stream=True, limits=LIMITS, now=now, budgets=reservation)


def spent(r, rules: list[BudgetRule], now: float = T0) -> list[int]:
    when = datetime.fromtimestamp(now, UTC)
    return [int(r.get(budgets.counter_key(1, x, window(x.period, when).label)) or 0)
            for x in rules]


def run(coro):  # one loop per test: the async client is per loop
    return asyncio.run(coro)


def test_unit_prices_are_exact_and_round_up():
    # 1000 prompt at 2/M + 500 out at 8/M = 0.002 + 0.004 = 0.006 USD = 6000 micro
    assert PRICES.micro_cost(1000, 0, 500) == 6000
    assert PRICES.micro_cost(1000, 400, 500) == 600 * 2 + 400 // 2 + 4000  # cached at 0.5/M
    assert PRICES.micro_cost(1, 0, 0) == 2 and PRICES.micro_cost(0, 0, 0) == 0
    odd = budgets.UnitPrices.per_mtok("USD", Decimal("0.000001"), Decimal(0), Decimal(0))
    assert odd.micro_cost(1, 0, 0) == 1  # 1e-12 USD rounds up to a micro-unit, never down


def test_reserve_then_settle_refunds_to_the_exact_cost(redis_client):
    rules = [rule("tenant", "1"), rule("key", "0.5", "day", "11"),
             rule("key", "100000", "lifetime", "11", metric="tokens")]

    async def go():
        assert isinstance(await admit("r1", rules), Admitted)
        assert spent(redis_client, rules) == [6000, 6000, 1500]
        assert await settlement.settle_async("p", "r1", status="ok", prompt_tokens=1000,
                                             cached_tokens=400, output_tokens=120, now=T0 + 5)
        cost = PRICES.micro_cost(1000, 400, 120)
        assert spent(redis_client, rules) == [cost, cost, 1120]
        # Exactly once: a second settle (the janitor, a retry) changes nothing.
        assert not await settlement.settle_async("p", "r1", status="ok", output_tokens=0)
        assert spent(redis_client, rules) == [cost, cost, 1120]
        await get_async_redis().aclose()
    run(go())


def test_a_request_that_would_cross_a_budget_is_refused_and_charged_nothing(redis_client):
    rules = [rule("tenant", "1"), rule("key", "0.010", "day", "11")]

    async def go():
        assert isinstance(await admit("a", rules), Admitted)  # 0.006 of 0.010
        before = spent(redis_client, rules)
        refused = await admit("b", rules)
        assert isinstance(refused, Rejected) and refused.reason == Reason.INSUFFICIENT_QUOTA
        assert refused.scope == "2" and refused.budget_used == 6000
        assert refused.retry_after == 61  # the day (UTC) ends in 60 s
        assert spent(redis_client, rules) == before  # nothing charged anywhere (B2)
        assert int(redis_client.get(admission.counter_key("conc", 1)) or 0) == 1
        # A smaller request still fits: the reservation is what is compared.
        assert isinstance(await admit("c", rules, prompt=1000, out=100), Admitted)
        await get_async_redis().aclose()
    run(go())


def test_cancel_while_queued_refunds_everything_and_failure_refunds_unused(redis_client):
    rules = [rule("tenant", "1")]

    async def go():
        await admit("q", rules)
        await settlement.settle_async("p", "q", status="cancelled", prompt_tokens=0,
                                      output_tokens=0)
        assert spent(redis_client, rules) == [0]
        await admit("f", rules)  # a worker died after 7 delivered tokens: the janitor's bill
        await settlement.settle_async("p", "f", status="error", now=T0 + 1)
        assert spent(redis_client, rules) == [PRICES.micro_cost(1000, 0, 0)]
        await get_async_redis().aclose()
    run(go())


def test_the_period_is_fixed_at_admission(redis_client):
    rules = [rule("tenant", "1", "month")]

    async def go():
        await admit("late", rules)  # admitted at 23:59 on 31 December
        await settlement.settle_async("p", "late", status="ok", prompt_tokens=1000,
                                      output_tokens=500, now=T0 + 120)  # settles in January
        january = T0 + 120
        assert spent(redis_client, rules) == [6000]  # December's counter holds its cost
        assert spent(redis_client, rules, january) == [0]  # January starts empty
        ttl = redis_client.ttl(budgets.counter_key(1, rules[0], "m202612"))
        assert 0 < ttl <= 60 + 1 + budgets.COUNTER_GRACE_S
        await get_async_redis().aclose()
    run(go())


def test_duplicate_id_unwinds_the_budget_reservation(redis_client):
    rules = [rule("tenant", "1")]

    async def go():
        await admit("d", rules)
        await settlement.settle_async("p", "d", status="ok", prompt_tokens=1000,
                                      output_tokens=0, now=T0)
        redis_client.delete(admission.token_keys(1)[0])  # the token is gone; req:d remains
        again = await admit("d", rules)
        assert isinstance(again, Rejected) and again.reason == Reason.DUPLICATE
        assert spent(redis_client, rules) == [2000]  # only the settled cost
        await get_async_redis().aclose()
    run(go())


def test_end_user_rules_and_identification():
    default = rule("end_user", "1", ident="")
    special = rule("end_user", "5", ident="alice")
    chain = KeyBudgets((rule("tenant", "10"),), (default,), {"alice": (special,)})
    assert chain.rules("") == chain.chain
    assert chain.rules("bob") == (*chain.chain, replace(default, ident="bob"))
    assert chain.rules("carol")[-1].ident == "carol"  # each end user has its own counter
    assert chain.rules("alice") == (*chain.chain, special)
    assert end_user_of({"user": "u1"}, {}) == "u1"
    assert end_user_of({"user": "u1", "safety_identifier": "s1"}, {}) == "s1"
    assert end_user_of({"user": "u1"}, {"x-end-user": "h1"}, "X-End-User") == "h1"
    assert end_user_of({"user": 5}, {}) == ""


def test_rate_limit_headers_state_the_reservation_rule(redis_client):
    """x-ratelimit-remaining-tokens is what is left after the reservation; a refusal always
    reserves more than remains (the issue saw 429s beside remaining 154-180, unexplained)."""
    tight = AdmissionLimits(tenant=ScopeLimits(input_tpm=10_000, output_tpm=300),
                            total_deadline_s=60)

    async def one(rid: str):
        return await admission.admit_async(
            request_id=rid, tenant_id=1, key_id=11, pool="p", model="m", prompt_tokens=10,
            max_output_tokens=200, stream=False, limits=tight, now=T0)

    async def go():
        first = await one("h1")
        assert isinstance(first, Admitted)
        headers = first.rate_limit.headers()
        assert headers["x-ratelimit-remaining-tokens"] == "100"  # 300 - 200 reserved
        assert headers["x-ratelimit-reserved-tokens"] == "200"
        second = await one("h2")
        assert isinstance(second, Rejected) and second.reason == Reason.OUTPUT_TOKENS
        h = second.headers()
        assert int(h["x-ratelimit-reserved-tokens"]) > int(h["x-ratelimit-remaining-tokens"])
        assert (h["x-ratelimit-remaining-tokens"], h["retry-after"]) == ("100", "20")
        await get_async_redis().aclose()
    run(go())


def test_a_price_change_during_a_period_applies_to_requests_admitted_after_it(redis_client):
    """A request settles at the price it was admitted at, even if a new price starts while it
    runs; the next request reserves and settles at the new price, in the same counter."""
    rules = [rule("tenant", "1")]
    dearer = budgets.UnitPrices.per_mtok("USD", Decimal("4"), Decimal("1"), Decimal("16"))

    async def go():
        await admit("old", rules)  # at 2/8 per million
        reservation = budgets.reserve(1, rules, dearer, 1000, 500, T0 + 10)
        assert await admission.admit_async(
            request_id="new", tenant_id=1, key_id=11, pool="p", model="m", prompt_tokens=1000,
            max_output_tokens=500, stream=True, limits=LIMITS, now=T0 + 10,
            budgets=reservation)
        for rid in ("old", "new"):
            await settlement.settle_async("p", rid, status="ok", prompt_tokens=1000,
                                          output_tokens=100, now=T0 + 20)
        assert spent(redis_client, rules) == [PRICES.micro_cost(1000, 0, 100)
                                              + dearer.micro_cost(1000, 0, 100)]
        await get_async_redis().aclose()
    run(go())


@pytest.mark.django_db
def test_the_gateway_reads_the_price_in_effect_at_admission():
    import time

    from gateway.inference import prices
    from tests.worlds import price

    prices.forget()
    now = datetime(2026, 12, 15, 12, tzinfo=UTC)
    price("sim-p", now.replace(hour=0), "2", "0.5", "8")
    price("sim-p", now.replace(hour=13), "4", "1", "16")  # made ahead, starts at 13:00
    for model in ("sim-p", "unpriced"):  # loaded here: the gateway's thread has no test data
        prices._books[model] = (time.monotonic(), prices._load(model))
    before = asyncio.run(prices.unit_prices("sim-p", now.timestamp()))
    after = asyncio.run(prices.unit_prices("sim-p", now.timestamp() + 3600))
    assert before == PRICES and after is not None and after.output == 16 * 10**6
    assert asyncio.run(prices.unit_prices("unpriced", now.timestamp())) is None


def test_the_usage_record_names_the_end_user(redis_client):
    """End users are metered per request (an identifier, never content, I4)."""
    from metering.writer import record_from_json
    from serving.submission import submit
    from serving.wire import SamplingParams
    from tests import rkeys

    async def go():
        result = await submit(tenant_id=1, key_id=11, weight=1.0, model="m", pool="p",
                              prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2),
                              limits=LIMITS, stream=False, request_id="eu-1",
                              context={"end_user": "alice"})
        await result.cancel("client_disconnect")
        await get_async_redis().aclose()
    procs_arun(go())
    [raw] = rkeys.usage_raw(redis_client)
    assert record_from_json(json.loads(raw)).end_user == "alice"


def procs_arun(coro):
    from tests.procs import arun
    return arun(coro)


def test_safety_identifier_is_validated_like_user():
    from gateway.inference.errors import ApiError
    from gateway.inference.requests import parse_object

    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_object({**base, "safety_identifier": "s1"}, "chat").safety_identifier == "s1"
    with pytest.raises(ApiError) as refused:
        parse_object({**base, "safety_identifier": 7}, "chat")
    assert refused.value.status == 400 and refused.value.param == "safety_identifier"
