"""The management API for projects and budgets: validation that names the field, this
period's spend and projection, keys in projects, and the OpenAPI description."""

from __future__ import annotations

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from tenants.auth import authenticate, clear_cache
from tenants.budgets import counter_key, rule_of, window
from tenants.models import ApiKey, Budget
from tests.factories import bearer
from tests.worlds import build_world

pytestmark = pytest.mark.django_db
T = "/api/tenants/acme"


@pytest.fixture
def world(redis_client):
    clear_cache()
    return build_world()


def api(world, who="owner"):
    client = APIClient()
    client.force_login(world.users[who])
    return client


def test_budgets_validate_and_report_spend(world, redis_client):
    client = api(world)
    bad = client.post(f"{T}/budgets/", {"level": "project", "limit": "5"}, format="json")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "project"
    other_key = world.keys["other"].id
    foreign = client.post(f"{T}/budgets/", {"level": "key", "api_key": other_key,
                                            "limit": "5"}, format="json")
    assert foreign.status_code == 400
    made = client.post(f"{T}/budgets/", {"level": "key", "api_key": world.keys["member"].id,
                                         "limit": "4", "period": "day"}, format="json")
    assert made.status_code == 201, made.content
    budget = Budget.objects.get(pk=made.json()["id"])
    rule = rule_of(budget)
    redis_client.set(counter_key(world.tenant.id, rule,
                                 window("day", timezone.now()).label), 1_000_000)
    body = client.get(f"{T}/budgets/{budget.pk}/").json()
    assert body["spent"] == "1" and body["percent"] == 25.0 and body["resets_at"]
    assert float(body["projected"]) >= 1.0
    again = client.post(f"{T}/budgets/", {"level": "key", "api_key": world.keys["member"].id,
                                          "limit": "9", "period": "day"}, format="json")
    assert again.status_code == 400  # one budget per scope, metric and period
    # The key's principal now carries the budget (the save renewed every cached principal).
    [held] = authenticate(bearer(world.plaintexts["member"])).budgets.chain
    assert held.limit == 4_000_000 and held.period == "day"


def test_projects_group_keys_and_narrow_models(world):
    client = api(world)
    project = client.post(f"{T}/projects/", {"name": "Staging", "slug": "staging",
                                             "allowed_models": ["sim-small"]}, format="json")
    assert project.status_code == 201, project.content
    pid = project.json()["id"]
    key = client.post(f"{T}/keys/", {"name": "ci", "project": pid}, format="json").json()
    assert key["project"] == pid and key["state"] == "active"
    principal = authenticate(bearer(key["key"]))
    assert principal.project_id == pid and principal.allows_model("sim-small")
    assert not principal.allows_model("sim-large")
    assert ApiKey.objects.get(pk=key["id"]).project_id == pid
    dup = client.post(f"{T}/projects/", {"name": "x", "slug": "staging"}, format="json")
    assert dup.status_code == 400 and dup.json()["error"]["param"] == "slug"


def test_budgets_and_projects_are_in_the_openapi_description(world):
    paths = api(world).get("/api/schema/?format=json").json()["paths"]
    for path in ("/api/tenants/{tenant}/budgets/", "/api/tenants/{tenant}/projects/",
                 "/api/tenants/{tenant}/keys/{id}/resume/"):
        assert path in paths, sorted(p for p in paths if "tenants/{tenant}" in p)


def test_usage_filters_by_end_user(world):
    from tests.worlds import record

    for who in ("alice", "bob", "alice"):
        r = record(world.tenant, world.keys["owner"], "sim-small", timezone.now())
        r.end_user = who
        r.save()
    body = api(world).get(f"{T}/usage/?end_user=alice").json()
    assert [r["end_user"] for r in body["results"]] == ["alice", "alice"]


def test_finance_export_has_budget_against_actual_per_level(world, redis_client):
    tenant_budget = Budget.objects.create(tenant=world.tenant, level="tenant", limit=10)
    Budget.objects.create(tenant=world.tenant, level="end_user", end_user="=cmd|' /C calc'!A0",
                          metric="tokens", limit=5000, period="day")
    rule = rule_of(tenant_budget)
    redis_client.set(counter_key(world.tenant.id, rule,
                                 window("month", timezone.now()).label), 2_500_000)
    response = api(world, "billing").get(f"{T}/budgets/export/")
    assert response.status_code == 200 and response["Content-Type"] == "text/csv"
    lines = response.content.decode().lstrip("\ufeff").splitlines()
    assert lines[0] == "level,scope,metric,period,limit,actual,percent,projected,currency," \
                       "resets_at"
    assert lines[1].startswith("end_user,end user =cmd")  # the cell starts with text
    assert lines[1].split(",")[7] == "0"  # tokens projected in whole tokens
    assert lines[2].startswith("tenant,tenant,money,month,10,2.5,25.0,")
