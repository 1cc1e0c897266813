"""Budget race: many concurrent streams through several gateways race the last cents of a key
budget and of a tenant budget; some clients hang up mid-stream. Prints each budget, the spend
its counter holds, the exact spend of the usage records (delivered tokens x price), and the
count of 200s and of 429 insufficient_quota. Overspend must be zero (docs/adr/0022).

    python bench/budget_race.py [--requests 400] [--gateways 2] [--key-budget 0.25]
                                [--tenant-budget 0.40] [--hang-up 0.3]

Prices are 1,000 USD per million tokens (0.001 USD a token), so a budget of cents is a few
dozen requests and one token leaked would show.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from datetime import UTC, datetime
from decimal import Decimal

from _http import System, TenantSpec, run_async, sse_post, stream_body

from infra.redis_conn import get_redis
from metering.billing.models import Price
from serving.budgets import UnitPrices
from tenants.api_keys import issue_key
from tenants.budgets import counter_key, rule_of, window
from tenants.models import Budget, Tenant

PER_MTOK = Decimal(1000)
PRICES = UnitPrices.per_mtok("USD", PER_MTOK, PER_MTOK, PER_MTOK)
QUOTA = {"input_tpm": 10**9, "output_tpm": 10**9, "concurrent_requests": 100_000,
         "open_streams": 100_000, "max_output_tokens": 4000}


def spent(budget: Budget) -> int:
    rule = rule_of(budget)
    label = window(rule.period, datetime.now(UTC)).label
    return int(get_redis().get(counter_key(budget.tenant_id, rule, label)) or 0)


async def race(system: System, keys: list[str], n: int, hang_up: float) -> list[object]:
    rng = random.Random(7)
    body = stream_body(system.model_name, 12)
    return list(await asyncio.gather(*(
        sse_post(system.urls[i % len(system.urls)], keys[i % len(keys)], body,
                 close_after_events=rng.randint(1, 6) if rng.random() < hang_up else None)
        for i in range(n))))


def report(name: str, budget: Budget, results: list[object], tenant_id: int,
           system: System) -> bool:
    records = [r for r in system.usage_records() if r["tenant_id"] == tenant_id]
    exact = sum(PRICES.micro_cost(r["prompt_tokens"], r["cached_tokens"],
                                  r["completion_tokens"]) for r in records)
    counter = spent(budget)
    ok = sum(getattr(r, "status", 0) == 200 for r in results)
    quota = sum(getattr(r, "error", "") == "insufficient_quota" for r in results)
    other = len(results) - ok - quota
    limit = int(budget.limit * 1_000_000)
    print(f"{name:14} budget {budget.limit:>6} USD  counter {Decimal(counter) / 10**6:>8} USD  "
          f"records {Decimal(exact) / 10**6:>8} USD  overspend "
          f"{Decimal(max(0, counter - limit)) / 10**6} USD  200s {ok:4}  "
          f"429 insufficient_quota {quota:4}  other {other}")
    return counter <= limit and counter == exact and other == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--key-budget", type=Decimal, default=Decimal("0.25"))
    parser.add_argument("--tenant-budget", type=Decimal, default=Decimal("0.40"))
    parser.add_argument("--hang-up", type=float, default=0.3,
                        help="share of clients that disconnect after a few tokens")
    args = parser.parse_args()
    engine = {"decode_tokens_per_s": 100.0, "pool_tokens_per_s": None}
    specs = [TenantSpec("keyb", quota=QUOTA), TenantSpec("tenantb", quota=QUOTA)]
    with System(backend_settings=engine, max_sequences=256, gateways=args.gateways,
                tenants=specs) as system:
        Price.objects.filter(model_name=system.model_name).delete()
        Price.objects.create(model_name=system.model_name, input_per_mtok=PER_MTOK,
                             cached_input_per_mtok=PER_MTOK, output_per_mtok=PER_MTOK,
                             effective_from=datetime(2020, 1, 1, tzinfo=UTC))
        key_tenant = Tenant.objects.get(slug="bench-keyb")
        key_budget = Budget.objects.create(tenant=key_tenant, level="key",
                                           api_key=key_tenant.api_keys.get(),
                                           limit=args.key_budget, period="month")
        shared = Tenant.objects.get(slug="bench-tenantb")
        second = issue_key(shared, "bench-2")[1]
        tenant_budget = Budget.objects.create(tenant=shared, level="tenant",
                                              limit=args.tenant_budget, period="day")
        try:
            started = time.perf_counter()
            by_key = run_async(race(system, [system.keys["keyb"]], args.requests, args.hang_up))
            by_tenant = run_async(race(system, [system.keys["tenantb"], second], args.requests,
                                       args.hang_up))
            took = time.perf_counter() - started
            deadline = time.time() + 30
            while time.time() < deadline and sum(
                    1 for r in system.usage_records()) < sum(
                    getattr(r, "status", 0) == 200 for r in (*by_key, *by_tenant)):
                time.sleep(0.2)
            print(f"{args.requests} requests per budget through {args.gateways} gateways, "
                  f"{args.hang_up:.0%} hanging up mid-stream, {took:.1f} s")
            good = [report("key budget", key_budget, by_key, key_tenant.id, system),
                    report("tenant budget", tenant_budget, by_tenant, shared.id, system)]
            print("zero overspend, counters = records" if all(good) else "FAILED")
        finally:
            Price.objects.filter(model_name=system.model_name).delete()


if __name__ == "__main__":
    main()
