"""Usage reports reconcile exactly with the raw usage records, summed both ways."""

from __future__ import annotations

import csv
import io
import random
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db.models import Count, Sum
from openpyxl import load_workbook

from metering.billing import reports
from metering.billing.models import Price
from metering.billing.pricing import PriceBook
from metering.models import UsageRecord
from tests.factories import make_key
from tests.worlds import build_world, price, record, roll_up, this_hour

pytestmark = pytest.mark.django_db


@pytest.fixture
def usage(redis_client):
    """~300 records over 30 hours, 2 tenants, 4 keys (one deleted later), 3 models, one
    unpriced, a price change in the middle of the range and a record outside it."""
    world = build_world()
    rng = random.Random(7)
    start = this_hour() - timedelta(hours=30)
    spare, _ = make_key(world.tenant, name="spare")
    keys = [world.keys["owner"], world.keys["member"], spare, world.keys["other"]]
    price("sim-small", start - timedelta(days=1), "0.5", "0.05", "1.5")
    price("sim-small", start + timedelta(hours=12), "0.75", "0.1", "2.25")
    price("sim-large", start - timedelta(days=1), "3", "0.3", "15", currency="EUR")
    records = []
    for _ in range(300):
        key = rng.choice(keys)
        prompt = rng.randint(1, 5000)
        records.append(record(
            key.tenant, key, rng.choice(["sim-small", "sim-large", "unpriced"]),
            start + timedelta(seconds=rng.randint(0, 30 * 3600 - 1)), prompt=prompt,
            cached=rng.randint(0, prompt), completion=rng.randint(0, 3000),
            status=rng.choice(["ok", "ok", "ok", "cancelled"]),
        ))
    records.append(record(world.tenant, keys[0], "sim-small", start - timedelta(minutes=1)))
    roll_up(*records)
    spare.delete()  # the bill outlives the key
    return world, start, start + timedelta(hours=30)


def _record_costs(start, end):
    """Each record costed on its own, at the price of its hour."""
    book = PriceBook()
    costs: dict[tuple, Decimal] = defaultdict(Decimal)
    for r in UsageRecord.objects.filter(finished_at__gte=start, finished_at__lt=end):
        hour = r.finished_at.replace(minute=0, second=0, microsecond=0)
        cost, currency = book.cost(r.model_name, hour, r.prompt_tokens, r.cached_tokens,
                                   r.completion_tokens)
        costs[(r.tenant_id, r.api_key_id, r.model_name, currency)] += cost
    return costs


def test_report_rows_equal_record_sums(usage):
    world, start, end = usage
    report = reports.build_report(start, end)
    expected = {
        (g["tenant_id"], g["api_key_id"], g["model_name"]): g
        for g in UsageRecord.objects.filter(finished_at__gte=start, finished_at__lt=end)
        .values("tenant_id", "api_key_id", "model_name")
        .annotate(n=Count("id"), p=Sum("prompt_tokens"), c=Sum("cached_tokens"),
                  o=Sum("completion_tokens"))
    }
    costs = _record_costs(start, end)
    assert len(report.rows) == len(expected)
    labels = {k.id: f"{k.name} ({k.masked})" for k in world.keys.values()}
    slugs = {world.tenant.id: "acme", world.other.id: "other"}
    rows = {(r.tenant, r.key, r.model): r for r in report.rows}
    for (tenant_id, key_id, model), g in expected.items():
        row = rows[(slugs[tenant_id], labels.get(key_id, f"(deleted key #{key_id})"), model)]
        assert (row.requests, row.input_tokens, row.cached_input_tokens, row.output_tokens) == (
            g["n"], g["p"], g["c"], g["o"])
        assert row.cost == costs[(tenant_id, key_id, model, row.currency)]


def test_totals_equal_all_records_and_the_sum_of_rows(usage):
    _, start, end = usage
    report = reports.build_report(start, end, group_by=("model",))
    raw = UsageRecord.objects.filter(finished_at__gte=start, finished_at__lt=end).aggregate(
        n=Count("id"), p=Sum("prompt_tokens"), c=Sum("cached_tokens"), o=Sum("completion_tokens"))
    totals = report.totals
    assert sum(t.requests for t in totals) == raw["n"] == sum(r.requests for r in report.rows)
    assert sum(t.input_tokens for t in totals) == raw["p"]
    assert sum(t.cached_input_tokens for t in totals) == raw["c"]
    assert sum(t.output_tokens for t in totals) == raw["o"]
    costs = _record_costs(start, end)
    for total in totals:
        assert total.cost == sum(v for k, v in costs.items() if k[3] == total.currency)
    assert {t.currency for t in totals} == {"", "EUR", "USD"}  # never added across currencies


def test_grouping_does_not_change_the_totals(usage):
    _, start, end = usage
    full = reports.build_report(start, end)
    for group_by in [(), ("tenant",), ("key",), ("model",), ("tenant", "model")]:
        other = reports.build_report(start, end, group_by=group_by)
        assert [(t.currency, t.requests, t.input_tokens, t.cost) for t in other.totals] == [
            (t.currency, t.requests, t.input_tokens, t.cost) for t in full.totals]


def test_csv_and_xlsx_carry_the_same_figures_and_a_totals_row(usage):
    _, start, end = usage
    report = reports.build_report(start, end)
    text = "".join(reports.csv_lines(report))
    assert text.startswith("\ufeff")  # the BOM Excel needs to read UTF-8
    rows = list(csv.reader(io.StringIO(text.removeprefix("\ufeff"))))
    assert rows[0] == report.columns
    body, totals = rows[1:len(report.rows) + 1], rows[len(report.rows) + 1:]
    assert [t[0] for t in totals] == ["TOTAL"] * len(report.totals)
    cost, currency = report.columns.index("cost"), report.columns.index("currency")
    usd = next(t for t in totals if t[currency] == "USD")
    # One rounding rule: each row to the cent, and the total is the sum of the printed rows.
    assert Decimal(usd[cost]) == sum(Decimal(r[cost]) for r in body if r[currency] == "USD")
    assert all(len(r[cost].split(".")[1]) == 2 for r in body if r[currency] == "USD")
    assert int(usd[3]) == sum(int(r[3]) for r in body if r[currency] == "USD")
    unpriced = [r for r in body if r[currency] == ""]
    assert unpriced and all(r[cost] == "" and r[-1].startswith("unpriced") for r in unpriced)

    buffer = io.BytesIO()
    reports.write_xlsx(report, buffer)
    sheet = load_workbook(io.BytesIO(buffer.getvalue())).active
    values = list(sheet.iter_rows(values_only=True))
    assert list(values[1]) == report.columns
    assert len(values) == 2 + len(report.rows) + len(report.totals)
    assert values[-1][0] == "TOTAL"
    assert sum(v[3] for v in values[2:2 + len(report.rows)]) == sum(
        t.requests for t in report.totals)


def test_member_scope_and_model_filter(usage):
    world, start, end = usage
    mine = reports.build_report(start, end, tenant=world.tenant,
                                api_key_ids=[world.keys["member"].id], model="sim-small")
    raw = UsageRecord.objects.filter(finished_at__gte=start, finished_at__lt=end,
                                     api_key=world.keys["member"], model_name="sim-small")
    assert sum(t.requests for t in mine.totals) == raw.count()
    assert {r.model for r in mine.rows} <= {"sim-small"}


def test_monthly_statement_covers_the_calendar_month():
    start, end = reports.month_range(2026, 12, UTC)
    assert (start, end) == (datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))


def test_a_price_starts_on_the_hour():
    def at(minute):
        return Price(model_name="m", input_per_mtok=1, cached_input_per_mtok=1,
                     output_per_mtok=1, effective_from=this_hour().replace(minute=minute))

    with pytest.raises(ValidationError):
        at(30).clean()
    at(0).clean()


def test_a_report_ending_now_includes_the_hour_in_progress(usage):
    world, _, end = usage
    roll_up(record(world.tenant, world.keys["owner"], "sim-small", end + timedelta(minutes=5)))
    report = reports.build_report(end, end + timedelta(minutes=10), group_by=())
    assert report.totals[0].requests == 1 and report.end == end + timedelta(hours=1)


def test_bad_group_by_is_refused():
    with pytest.raises(ValueError, match="cannot group by"):
        reports.parse_group_by("tenant,colour")
