"""The portal's budgets page (progress per level, projected end-of-period spend), the key list
saying "over budget" (never "expired"), and resuming a key: owners change, billing reads,
members see neither."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from tenants.budgets import counter_key, rule_of, window
from tenants.models import ApiKey, Budget
from tests.worlds import build_world

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(redis_client):
    world = build_world()
    world.budget = Budget.objects.create(tenant=world.tenant, level="key",
                                         api_key=world.keys["member"], limit=Decimal("2"),
                                         period="month")
    rule = rule_of(world.budget)
    redis_client.set(counter_key(world.tenant.id, rule,
                                 window(rule.period, timezone.now()).label), 1_500_000)
    return world


def signed_in(client, world, who):
    client.force_login(world.users[who])
    return client


def test_budgets_page_shows_progress_and_projection(client, world):
    page = signed_in(client, world, "owner").get(reverse("portal:budgets")).content.decode()
    assert "1.50 USD" in page and 'value="75.0"' in page and "75.0%" in page
    assert "Projected at the end" in page and "Add a budget" in page
    billing = signed_in(client, world, "billing").get(reverse("portal:budgets"))
    assert billing.status_code == 200 and "Add a budget" not in billing.content.decode()
    member = signed_in(client, world, "member").get(reverse("portal:budgets"))
    assert member.status_code == 403


def test_only_owners_add_and_remove_budgets(client, world):
    form = {"level": "tenant", "metric": "money", "limit": "50", "currency": "USD",
            "period": "week"}
    signed_in(client, world, "billing").post(reverse("portal:budgets"), form)
    assert Budget.objects.filter(tenant=world.tenant).count() == 1
    response = signed_in(client, world, "owner").post(reverse("portal:budgets"), form)
    assert response.status_code == 302
    assert Budget.objects.filter(tenant=world.tenant, period="week").exists()
    bad = dict(form, level="project")  # a project budget without a project
    page = client.post(reverse("portal:budgets"), bad).content.decode()
    assert "Set project exactly when the level is project" in page
    client.post(reverse("portal:budget_delete", args=[world.budget.pk]))
    assert not Budget.objects.filter(pk=world.budget.pk).exists()


def test_a_key_over_budget_reads_so_and_an_owner_resumes_it(client, world):
    key = world.keys["member"]
    ApiKey.objects.filter(pk=key.pk).update(over_budget_at=timezone.now())
    member = signed_in(client, world, "member")
    listing = member.get(reverse("portal:keys")).content.decode()
    assert "over budget" in listing and "expired" not in listing
    assert member.post(reverse("portal:key_resume", args=[key.pk])).status_code == 403
    owner = signed_in(client, world, "owner")
    assert "over-budget" in owner.get(reverse("portal:budgets")).content.decode()
    assert owner.post(reverse("portal:key_resume", args=[key.pk])).status_code == 302
    assert ApiKey.objects.get(pk=key.pk).state() == "active"


def test_keys_are_made_in_projects_and_listed_with_them(client, world):
    from tenants.models import Project

    web = Project.objects.create(tenant=world.tenant, name="webshop", slug="web")
    Project.objects.create(tenant=world.other, name="theirs", slug="theirs")
    owner = signed_in(client, world, "owner")
    form_page = owner.get(reverse("portal:key_create")).content.decode()
    assert "webshop" in form_page and "theirs" not in form_page
    owner.post(reverse("portal:key_create"), {"name": "shop key", "project": web.pk})
    assert ApiKey.objects.get(name="shop key").project == web
    assert "· webshop" in owner.get(reverse("portal:keys")).content.decode()


def test_usage_by_end_user_on_the_budgets_page(client, world):
    from datetime import timedelta

    from tests.worlds import price, record, this_hour

    now = this_hour()
    price("sim-small", now - timedelta(days=40), "40", "0", "0")  # 100 prompt = 0.004 USD
    for who in ("alice", "alice", "bob", ""):
        r = record(world.tenant, world.keys["owner"], "sim-small", now, prompt=100,
                   completion=0)
        r.end_user = who
        r.save()
    page = signed_in(client, world, "billing").get(reverse("portal:budgets")).content.decode()
    table = page[page.index('id="end-users"'):]
    assert table.index("alice") < table.index("bob")  # most tokens first
    assert "0.01 USD" in table and "0.00 USD" in table  # 0.008 and 0.004, each rounded once
