"""A report as an HTTP download, shared by the portal and the API."""

from __future__ import annotations

import io

from django.http import HttpResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase

from metering.billing import reports

XLSX_TYPE = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"


def report_response(report: reports.Report, fmt: str, filename: str,
                    title: str | None = None) -> HttpResponseBase:
    """A small report straight in the response: CSV streamed line by line, XLSX in memory."""
    if fmt == "xlsx":
        buffer = io.BytesIO()
        reports.write_xlsx(report, buffer, title=title)
        response: HttpResponseBase = HttpResponse(buffer.getvalue(), content_type=XLSX_TYPE)
    else:
        response = StreamingHttpResponse(reports.csv_lines(report), content_type="text/csv")
    response["Content-Disposition"] = f'attachment; filename="{filename}.{fmt}"'
    return response
