"""A shared world for portal, API and billing tests, and the helpers that fill it.

Tenant ``acme`` has an owner, a member and a billing user; ``other`` has its own owner (the
outsider for acme); ``staff`` is a platform staff account with no permissions and no grants
(it must see nothing), ``admin`` a superuser (every platform permission, still no tenant
role). Each test module wraps ``build_world`` in a fixture, so every seat exists on every
endpoint test. Passwords hash with the fast hasher that ``tests/conftest.py`` puts in
place for every test.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal

from django.contrib.auth import get_user_model
from django.utils import timezone

from catalog.models import Pool, ServedModel
from metering.billing.models import Price
from metering.models import UsageRecord
from metering.rollups import rollup_hour
from tenants.models import ApiKey, Membership, Tenant
from tests.factories import make_key, make_model, make_pool, make_tenant

PASSWORD = "correct horse battery staple 9"
_rid = itertools.count(1)


@dataclass
class World:
    tenant: Tenant
    other: Tenant
    model: ServedModel
    pool: Pool
    users: dict[str, object]
    keys: dict[str, ApiKey] = field(default_factory=dict)
    plaintexts: dict[str, str] = field(default_factory=dict)


def make_user(username: str, **extra: object) -> object:
    return get_user_model().objects.create_user(
        username, email=f"{username}@example.test", password=PASSWORD, **extra
    )


def build_world() -> World:
    tenant, other = make_tenant("acme"), make_tenant("other")
    model = make_model("sim-small")
    pool = make_pool(model, name="shared-small")
    users = {name: make_user(name) for name in ("owner", "member", "billing", "outsider")}
    users["staff"] = make_user("staff", is_staff=True)
    users["admin"] = make_user("admin", is_staff=True, is_superuser=True)
    for name, role in (("owner", "owner"), ("member", "member"), ("billing", "billing")):
        Membership.objects.create(user=users[name], tenant=tenant, role=role)
    Membership.objects.create(user=users["outsider"], tenant=other, role="owner")
    world = World(tenant, other, model, pool, users)
    for name, tenant_, user in (("owner", tenant, "owner"), ("member", tenant, "member"),
                                ("other", other, "outsider")):
        key, plaintext = make_key(tenant_, name=f"{name} key", created_by=users[user])
        world.keys[name], world.plaintexts[name] = key, plaintext
    return world


def record(tenant: Tenant, key: ApiKey | None, model: str, finished: datetime, *,
           prompt: int = 100, cached: int = 0, completion: int = 50, ttft: int | None = 120,
           status: str = "ok", end_user: str = "") -> UsageRecord:
    return UsageRecord.objects.create(
        request_id=f"req-{next(_rid)}", tenant=tenant, api_key=key, model_name=model,
        prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion, ttft_ms=ttft,
        total_ms=(ttft or 0) + 500, status=status, started_at=finished - timedelta(seconds=1),
        finished_at=finished, end_user=end_user,
    )


def roll_up(*records: UsageRecord) -> None:
    for hour in {r.finished_at.replace(minute=0, second=0, microsecond=0) for r in records}:
        rollup_hour(hour)


def price(model: str, start: datetime, inp: str, cached: str, out: str,
          currency: str = "USD") -> Price:
    return Price.objects.create(
        model_name=model, effective_from=start, input_per_mtok=Decimal(inp),
        cached_input_per_mtok=Decimal(cached), output_per_mtok=Decimal(out), currency=currency,
    )


def this_hour() -> datetime:
    return timezone.now().replace(minute=0, second=0, microsecond=0)

