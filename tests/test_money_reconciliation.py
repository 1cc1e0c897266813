"""One money rule everywhere (ADR 0013, amended): the same usage shows the same total however
it is grouped, on the statement, in every report grouping, the dashboard, the admin and the
API; the rows of any grouping add up to that total."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from metering.billing import reports
from metering.billing.admin import TenantWithUsageAdmin
from metering.billing.money import allocate, total_amount
from tests.factories import make_key
from tests.worlds import build_world, price, record, roll_up, this_hour

pytestmark = pytest.mark.django_db
GROUPINGS = [(), ("tenant",), ("key",), ("model",), ("end_user",), ("tenant", "model"),
             ("model", "key"), ("tenant", "key", "model"), ("project", "end_user"),
             ("tenant", "project", "key", "model", "end_user")]


def test_allocate_adds_up_to_the_rounded_exact_total():
    costs = [Decimal("0.004")] * 3
    assert total_amount(costs, "USD") == Decimal("0.01")
    assert allocate(costs, "USD") == [Decimal("0.01"), Decimal("0.00"), Decimal("0.00")]
    costs = [Decimal("0.0053")] * 3 + [Decimal("1.999")]
    amounts = allocate(costs, "USD")
    assert sum(amounts) == total_amount(costs, "USD") == Decimal("2.01")  # 2.0149
    assert all(abs(a - c) < Decimal("0.01") for a, c in zip(amounts, costs, strict=True))
    assert allocate([Decimal("12.5"), Decimal("12.5")], "JPY") == [Decimal(13), Decimal(12)]
    assert allocate([], "USD") == []


@pytest.fixture
def three_keys(redis_client):
    """Three keys that cost 0.004 USD each this month (100 prompt tokens at 40 USD/Mtok)."""
    world = build_world()
    now = this_hour()
    price("sim-small", now - timedelta(days=40), "40", "0", "0")
    keys = [world.keys["owner"], world.keys["member"], make_key(world.tenant, name="third")[0]]
    # Two end users and one request without one, so an end-user grouping has three rows.
    roll_up(*[record(world.tenant, key, "sim-small", now, prompt=100, completion=0,
                     end_user=user)
              for key, user in zip(keys, ["alice", "bob", ""], strict=True)])
    return world, now


def test_three_keys_at_0_004_reconcile_in_every_grouping(three_keys):
    world, now = three_keys
    start, end = reports.month_range(now.year, now.month, now.tzinfo)
    for group_by in GROUPINGS:
        report = reports.build_report(start, end, tenant=world.tenant, group_by=group_by)
        assert [t.amount for t in report.totals] == [Decimal("0.01")], group_by
        assert [t.cost for t in report.totals] == [Decimal("0.012")], group_by
        assert sum(r.amount for r in report.rows) == Decimal("0.01"), group_by


def test_statement_api_dashboard_and_admin_show_the_same_total(three_keys, client):
    world, now = three_keys
    api = APIClient()
    api.force_login(world.users["billing"])
    statement = api.get(f"/api/tenants/acme/reports/statements/{now:%Y-%m}/").json()
    assert Decimal(statement["totals"][0]["amount"]) == Decimal("0.01")
    assert sum(Decimal(r["amount"]) for r in statement["rows"]) == Decimal("0.01")
    start = (now - timedelta(hours=1)).date().isoformat()
    for group_by in ("tenant", "key", "model"):
        body = api.get(f"/api/tenants/acme/reports/?start={start}&group_by={group_by}").json()
        assert Decimal(body["totals"][0]["amount"]) == Decimal("0.01"), group_by
    admin_text = TenantWithUsageAdmin.month_usage(None, world.tenant)  # type: ignore[arg-type]
    assert "0.01 USD" in admin_text
    client.force_login(world.users["owner"])
    keys_page = client.get(reverse("portal:keys")).content.decode()
    assert keys_page.count("0.01 USD") == 1 and keys_page.count("0.00 USD") == 2
    usage_page = client.get(reverse("portal:usage")).content.decode()
    assert "0.01 USD" in usage_page and "0.00 USD" not in usage_page


def test_reports_group_by_project_and_reconcile(three_keys):
    from tenants.models import Project

    world, now = three_keys
    web = Project.objects.create(tenant=world.tenant, name="web", slug="web")
    world.keys["owner"].project = web
    world.keys["owner"].save()
    start, end = reports.month_range(now.year, now.month, now.tzinfo)
    report = reports.build_report(start, end, tenant=world.tenant, group_by=("project",))
    assert [(r.project, r.requests, r.cost) for r in report.rows] == [
        ("(no project)", 2, Decimal("0.008")), ("web", 1, Decimal("0.004"))]
    assert sum(r.amount for r in report.rows) == report.totals[0].amount == Decimal("0.01")
    api = APIClient()
    api.force_login(world.users["billing"])
    body = api.get(f"/api/tenants/acme/reports/?start={now.date().isoformat()}"
                   "&group_by=project,model").json()
    assert {r["project"] for r in body["rows"]} == {"(no project)", "web"}


def test_reports_group_by_end_user_and_reconcile(three_keys):
    world, now = three_keys
    start, end = reports.month_range(now.year, now.month, now.tzinfo)
    report = reports.build_report(start, end, tenant=world.tenant, group_by=("end_user",))
    assert [(r.end_user, r.requests, r.cost) for r in report.rows] == [
        ("(no end user)", 1, Decimal("0.004")), ("alice", 1, Decimal("0.004")),
        ("bob", 1, Decimal("0.004"))]
    assert sum(r.amount for r in report.rows) == report.totals[0].amount == Decimal("0.01")
    api = APIClient()
    api.force_login(world.users["billing"])
    body = api.get(f"/api/tenants/acme/reports/?start={now.date().isoformat()}"
                   "&group_by=end_user,model").json()
    assert body["group_by"] == ["model", "end_user"]
    assert {r["end_user"] for r in body["rows"]} == {"(no end user)", "alice", "bob"}
    assert Decimal(body["totals"][0]["amount"]) == Decimal("0.01")
    answer = api.get(f"/api/tenants/acme/reports/?start={now.date().isoformat()}"
                     "&group_by=end_user&file=csv")
    csv_text = b"".join(answer.streaming_content).decode("utf-8-sig")
    assert csv_text.splitlines()[0].startswith("end_user,requests")
    assert "alice" in csv_text and "TOTAL" in csv_text


def test_portal_report_and_finance_export_group_by_end_user(three_keys, client):
    from metering.billing import exports

    world, now = three_keys
    client.force_login(world.users["billing"])
    page = client.get(reverse("portal:reports")).content.decode()
    assert 'value="end_user"' in page
    response = client.post(reverse("portal:reports"), {
        "start": (now - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M"),
        "end": (now + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M"),
        "group_by": ["end_user"], "format": "csv"})
    lines = b"".join(response.streaming_content).decode("utf-8-sig").splitlines()
    assert lines[0].startswith("end_user,") and lines[-1].startswith("TOTAL,3,")
    assert lines[-1].split(",")[5] == "0.01"  # the statement's total
    job = exports.queue_export(tenant=world.tenant, user=None, start=now - timedelta(days=1),
                               end=now + timedelta(hours=1), group_by="end_user", fmt="csv")
    assert job.group_by == "end_user"
