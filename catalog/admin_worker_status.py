"""The Pool admin shows how ``manage.py serve`` finds the pool's worker process.

``catalog.serve_status`` holds what serve last reported (starting, running, restarting after an
exit, failing: exited again and again), how the worker's last run ended and the last lines it
printed, e.g. the engine's complaint about a bad ``backend_settings`` entry. The change page
shows it in full (and a warning while the worker is failing), the list a one-word state.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from catalog import serve_status

NOT_REPORTED = "not run by manage.py serve"


def status_html(pool: Any) -> SafeString:
    record = serve_status.read(pool.name) if getattr(pool, "pk", None) else None
    if record is None:
        return format_html("<p>{}</p>", NOT_REPORTED)
    at = dt.datetime.fromtimestamp(float(record.get("at") or 0), tz=dt.UTC)
    line = format_html("<p><strong>{}</strong> (pid {}, {} restarts, as of {} UTC)</p>",
                       record.get("state", "?"), record.get("pid") or "-",
                       record.get("restarts", "0"), f"{at:%Y-%m-%d %H:%M:%S}")
    if not record.get("last_exit"):
        return line
    return format_html("{}<p>Last exit: {}</p><pre>{}</pre>", line, record["last_exit"],
                       record.get("output", ""))


class WorkerStatusAdminMixin:
    """Adds the worker's status to a ``ModelAdmin`` for ``Pool``."""

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return [*super().get_readonly_fields(request, obj), "worker_status"]  # type: ignore[misc]

    def get_list_display(self, request: HttpRequest) -> Any:
        return [*super().get_list_display(request), "worker_state"]  # type: ignore[misc]

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: dict[str, Any] | None = None) -> HttpResponse:
        pool = self.get_object(request, object_id)  # type: ignore[attr-defined]
        record = serve_status.read(pool.name) if pool is not None else None
        if record and record.get("state") == "failing" and request.method == "GET":
            messages.warning(request, f"This pool's worker keeps exiting ({record['last_exit']}); "
                                      "see its status below and the serve log.")
        return super().change_view(request, object_id, form_url,  # type: ignore[misc]
                                   extra_context)

    def worker_status(self, obj: Any) -> SafeString:
        return status_html(obj)

    def worker_state(self, obj: Any) -> str:
        record = serve_status.read(obj.name)
        return record.get("state", "-") if record else "-"

    worker_status.short_description = "worker (manage.py serve)"  # type: ignore[attr-defined]
    worker_state.short_description = "worker"  # type: ignore[attr-defined]
