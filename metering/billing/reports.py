"""Usage reports from the hourly rollups: grouped token counts, requests and cost, with totals.

A report covers whole hours, because that is the grain of ``UsageRollup``: every hour that
starts in ``[start, end)`` with ``start`` floored to its hour, so an ``end`` of "now" includes the
hour in progress; each rollup row is costed at the price in effect at its hour (prices start on
the hour, ``Price.clean``), so the cost equals the sum of every record's own cost exactly.
Rows are grouped by any of tenant, project (the key's project now), key, model and end user
(the request's end user, kept in each rollup row), and by currency, because amounts in two
currencies are never added together; the totals come one row per currency.

``cost`` stays exact (it reconciles with the records); ``amount`` is what people read and are
billed: a total's amount is its exact cost rounded once (``money.total_amount``), so every
grouping gives the same total, and the rows' amounts are that total allocated by largest
remainder (``money.allocate``), so they add up to it. Usage without a price has no amount
(``None``) and is flagged "unpriced" in every file, never written as a zero.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import IO

from django.db.models import QuerySet

from metering.billing.money import UNPRICED, allocate, minor_unit, total_amount
from metering.billing.pricing import PriceBook
from metering.billing.spreadsheet import safe_cell, safe_row
from metering.models import UsageRollup
from tenants.models import ApiKey, Project, Tenant

GROUPS = ("tenant", "project", "key", "model", "end_user")
DEFAULT_GROUPS = ("tenant", "key", "model")
NO_END_USER = "(no end user)"
PROGRESS_EVERY = 1000
Progress = Callable[[int, int], None]


def floor_hour(when: datetime) -> datetime:
    return when.replace(minute=0, second=0, microsecond=0)


def ceil_hour(when: datetime) -> datetime:
    floor = floor_hour(when)
    return floor if floor == when else floor + timedelta(hours=1)


def month_range(year: int, month: int, tz: object) -> tuple[datetime, datetime]:
    start = datetime(year, month, 1, tzinfo=tz)  # type: ignore[arg-type]
    end = datetime(year + month // 12, month % 12 + 1, 1, tzinfo=tz)  # type: ignore[arg-type]
    return start, end


@dataclass
class ReportRow:
    tenant: str = ""
    project: str = ""
    key: str = ""
    model: str = ""
    end_user: str = ""
    currency: str = ""
    requests: int = 0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    cost: Decimal = field(default_factory=Decimal)
    amount: Decimal | None = None  # set by build_report: the rounded, billable figure
    key_id: int | None = None  # when grouped by key

    @property
    def priced(self) -> bool:
        return bool(self.currency)

    def add(self, requests: int, prompt: int, cached: int, completion: int, cost: Decimal) -> None:
        self.requests += requests
        self.input_tokens += prompt
        self.cached_input_tokens += cached
        self.output_tokens += completion
        self.cost += cost


@dataclass
class Report:
    start: datetime
    end: datetime
    group_by: tuple[str, ...]
    rows: list[ReportRow]
    totals: list[ReportRow]  # one per currency, then unpriced usage ('')

    @property
    def columns(self) -> list[str]:
        return [*self.group_by, "requests", "input_tokens", "cached_input_tokens",
                "output_tokens", "cost", "currency", "note"]

    def cells(self, row: ReportRow, label: str | None = None) -> list[object]:
        groups = [getattr(row, g) for g in self.group_by]
        if label is not None:
            groups = [label, *[""] * (len(groups) - 1)] if groups else []
        return [*groups, row.requests, row.input_tokens, row.cached_input_tokens,
                row.output_tokens, row.amount if row.priced else None, row.currency,
                "" if row.priced else f"{UNPRICED}: no price for this model at that hour"]

    def table(self) -> Iterator[list[object]]:
        """Header, rows, then the totals rows labelled TOTAL."""
        yield [*self.columns]
        for row in self.rows:
            yield self.cells(row)
        for total in self.totals:
            yield self.cells(total, label="TOTAL")


def parse_group_by(text: str | Iterable[str]) -> tuple[str, ...]:
    """'tenant,model' -> ('tenant', 'model') in canonical order; ValueError names a bad one."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    unknown = sorted(set(names) - set(GROUPS))
    if unknown:
        raise ValueError(f"cannot group by {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    return tuple(g for g in GROUPS if g in names)


def rollups(
    start: datetime, end: datetime, *, tenant: Tenant | None = None,
    api_key_ids: Sequence[int] | None = None, model: str | None = None,
) -> QuerySet[UsageRollup]:
    qs = UsageRollup.objects.filter(hour__gte=floor_hour(start), hour__lt=end)
    if tenant is not None:
        qs = qs.filter(tenant=tenant)
    if api_key_ids is not None:
        qs = qs.filter(api_key_id__in=list(api_key_ids))
    if model:
        qs = qs.filter(model_name=model)
    return qs


def build_report(
    start: datetime, end: datetime, *, tenant: Tenant | None = None,
    group_by: Sequence[str] = DEFAULT_GROUPS, api_key_ids: Sequence[int] | None = None,
    model: str | None = None, progress: Progress | None = None,
) -> Report:
    qs = rollups(start, end, tenant=tenant, api_key_ids=api_key_ids, model=model)
    total = qs.count() if progress else 0
    book = PriceBook(qs.values_list("model_name", flat=True).distinct().order_by())
    groups: dict[tuple[object, ...], ReportRow] = {}
    projects = _key_projects(tenant) if "project" in group_by else {}
    fields = ("tenant_id", "api_key_id", "model_name", "end_user", "hour", "requests",
              "prompt_tokens", "cached_tokens", "completion_tokens")
    done = 0
    for tid, kid, model_name, end_user, hour, n, prompt, cached, completion in (
        qs.order_by().values_list(*fields).iterator(chunk_size=2000)
    ):
        cost, currency = book.cost(model_name, hour, prompt, cached, completion)
        ident = {"tenant": tid, "key": kid, "model": model_name,
                 "project": projects.get(kid), "end_user": end_user}
        group = (*(ident[g] for g in group_by), currency)
        row = groups.setdefault(group, ReportRow(currency=currency))
        row.add(n, prompt, cached, completion, cost)
        done += 1
        if progress and done % PROGRESS_EVERY == 0:
            progress(done, total)
    rows = _label(groups, tuple(group_by))
    _allocate_amounts(rows)
    if progress:
        progress(done, total)
    return Report(floor_hour(start), ceil_hour(end), tuple(group_by), rows, _totals(rows))


def _key_projects(tenant: Tenant | None) -> dict[int, int]:
    """Key id -> project id, for keys in a project (usage follows the key's project now)."""
    keys = ApiKey.objects.filter(project__isnull=False)
    if tenant is not None:
        keys = keys.filter(tenant=tenant)
    return {k: p for k, p in keys.values_list("id", "project_id") if p is not None}


def _id(value: object) -> int | None:
    """A tenant or key id of a group's key (None: usage made with no key)."""
    return value if isinstance(value, int) else None


def _label(
    groups: dict[tuple[object, ...], ReportRow], group_by: tuple[str, ...]
) -> list[ReportRow]:
    """Fill in tenant and key names (two queries) and sort the rows for reading."""
    position = {g: i for i, g in enumerate(group_by)}
    tenant_ids = {_id(k[position["tenant"]]) for k in groups} if "tenant" in position else set()
    key_ids = {_id(k[position["key"]]) for k in groups} if "key" in position else set()
    tenants: dict[int | None, str] = dict(Tenant.objects.filter(
        id__in={i for i in tenant_ids if i is not None}).values_list("id", "slug"))
    keys: dict[int | None, str] = {
        k.id: f"{k.name} ({k.masked})" for k in ApiKey.objects.filter(
            id__in={i for i in key_ids if i is not None})}
    project_ids = {_id(k[position["project"]]) for k in groups} if "project" in position \
        else set()
    projects: dict[int | None, str] = dict(Project.objects.filter(
        id__in={i for i in project_ids if i is not None}).values_list("id", "name"))
    for ident, row in groups.items():
        if "tenant" in position:
            tid = _id(ident[position["tenant"]])
            row.tenant = tenants.get(tid, f"(deleted tenant #{tid})")
        if "project" in position:
            pid = _id(ident[position["project"]])
            row.project = "(no project)" if pid is None else projects.get(pid, f"#{pid}")
        if "key" in position:
            kid = _id(ident[position["key"]])
            row.key_id = kid
            row.key = "(no key)" if kid is None else keys.get(kid, f"(deleted key #{kid})")
        if "model" in position:
            row.model = str(ident[position["model"]])
        if "end_user" in position:
            row.end_user = str(ident[position["end_user"]]) or NO_END_USER
    return sorted(groups.values(),
                  key=lambda r: (r.tenant, r.project, r.key, r.model, r.end_user, r.currency))


def _allocate_amounts(rows: list[ReportRow]) -> None:
    """Each currency's rows get amounts adding up to that currency's rounded exact total."""
    for currency in {r.currency for r in rows if r.priced}:
        mine = [r for r in rows if r.currency == currency]
        for row, amount in zip(mine, allocate([r.cost for r in mine], currency), strict=True):
            row.amount = amount


def _totals(rows: list[ReportRow]) -> list[ReportRow]:
    by_currency: dict[str, ReportRow] = {}
    for row in rows:
        total = by_currency.setdefault(row.currency, ReportRow(currency=row.currency))
        total.add(row.requests, row.input_tokens, row.cached_input_tokens, row.output_tokens,
                  row.cost)
    for currency, total in by_currency.items():
        total.amount = total_amount(
            (r.cost for r in rows if r.currency == currency), currency) if currency else None
    # Priced currencies first, the unpriced usage (currency '') last, as a statement reads.
    order = sorted(by_currency, key=lambda c: (c == "", c))
    return [by_currency[c] for c in order] or [ReportRow()]


# --- files ---------------------------------------------------------------------------------
# Every cell goes through ``cells.safe_row`` (no formulas from key or model names). CSV starts
# with a UTF-8 byte order mark, without which Excel reads UTF-8 as the local code page.

BOM = "\ufeff"
INT_FORMAT = "#,##0"
COLUMN_WIDTHS = {"tenant": 24, "project": 24, "key": 36, "model": 24, "end_user": 28,
                 "cost": 14, "currency": 9, "note": 44}


def _text(value: object) -> object:
    return f"{value:f}" if isinstance(value, Decimal) else value


def csv_lines(report: Report) -> Iterator[str]:
    """The report as CSV, one line at a time (for a streaming response), BOM first."""
    buffer = io.StringIO()
    buffer.write(BOM)
    writer = csv.writer(buffer)
    for cells in report.table():
        writer.writerow([_text(c) for c in safe_row(cells)])
        yield buffer.getvalue()
        buffer.seek(0)
        buffer.truncate()


def write_csv(report: Report, out: IO[str]) -> None:
    for line in csv_lines(report):
        out.write(line)


def _money_format(currency: str) -> str:
    places = minor_unit(currency) if currency else 2
    return "#,##0" + ("." + "0" * places if places else "")


def write_xlsx(report: Report, out: IO[bytes], title: str | None = None) -> None:
    """Numbers stay numbers, with thousands separators and the currency's decimals; columns
    are wide enough to read, the header row is frozen, headers and totals are bold. ``title``
    (a statement's: tenant, month, issue date) heads the sheet and names the document."""
    from openpyxl import Workbook
    from openpyxl.cell import WriteOnlyCell
    from openpyxl.styles import Font
    from openpyxl.utils import get_column_letter

    book = Workbook(write_only=True)
    sheet = book.create_sheet("statement" if title else "usage")
    if title:
        book.properties.title = title
    columns = report.columns
    for index, name in enumerate(columns, start=1):
        sheet.column_dimensions[get_column_letter(index)].width = COLUMN_WIDTHS.get(name, 16)
    sheet.freeze_panes = "A3"
    sheet.append([safe_cell(title) if title else
                  f"Usage {report.start:%Y-%m-%d %H:00} to {report.end:%Y-%m-%d %H:00} UTC"])
    bold = Font(bold=True)
    n_rows = len(report.rows)
    all_rows = [*report.rows, *report.totals]
    cost_at = columns.index("cost")
    for index, cells in enumerate(report.table()):
        row = all_rows[index - 1] if index else None
        out_cells = []
        for position, value in enumerate(safe_row(cells)):
            # The stubs allow str | float | datetime | None; openpyxl writes Decimal amounts too.
            cell = WriteOnlyCell(sheet, value=value)  # type: ignore[arg-type]
            if row is not None and isinstance(value, int | Decimal):
                cell.number_format = (_money_format(row.currency) if position == cost_at
                                      else INT_FORMAT)
            if index == 0 or index > n_rows:  # header and totals in bold
                cell.font = bold
            out_cells.append(cell)
        sheet.append(out_cells)
    book.save(out)
