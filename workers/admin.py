"""The Pool admin: a catalog row with what its workers report (live state from their
heartbeats and the queue, ``serve``'s record of the worker process, the capacity plan), its
``backend_settings`` checked with the engine backends' own rules before it is saved.

It sits here, above ``catalog`` and ``serving``, because it reads both and the engine
registry: nothing needs registering from above.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from catalog.admin_planner import CapacityPlanAdminMixin
from catalog.admin_worker_status import WorkerStatusAdminMixin
from catalog.models import Pool
from serving.pool_status import pool_state
from workers.engine.registry import check_pool_settings


class PoolForm(forms.ModelForm):
    """``backend_settings`` checked against the chosen backend's keys before saving, with the
    engine registry's own rules, so a typo is an error naming the key, not a worker that
    fails to start."""

    class Meta:
        model = Pool
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        cleaned: dict[str, Any] = super().clean() or {}
        settings_ = cleaned.get("backend_settings")
        if "backend_settings" in self.errors or cleaned.get("backend") is None:
            return cleaned
        if not isinstance(settings_, dict):
            self.add_error("backend_settings", "Must be a JSON object, e.g. {\"base_url\": …}.")
            return cleaned
        try:
            check_pool_settings(cleaned.get("name") or "this pool", cleaned["backend"], settings_,
                                cleaned.get("dedicated_to") is not None)
        except ValueError as exc:
            self.add_error("backend_settings", str(exc))
        return cleaned


@admin.register(Pool)
class PoolAdmin(WorkerStatusAdminMixin, CapacityPlanAdminMixin, admin.ModelAdmin):
    form = PoolForm
    list_display = ["name", "model", "region", "cell", "backend", "live", "max_sequences",
                    "kv_cache_tokens", "dedicated_to", "enabled"]
    list_filter = ["enabled", "backend", "region", "cell", "model"]
    search_fields = ["name", "model__name", "region", "dedicated_to__slug"]
    list_select_related = ["model", "dedicated_to"]
    autocomplete_fields = ["dedicated_to"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return [*super().get_readonly_fields(request, obj), "live_status"]

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = [(name, {**opts, "fields": [f for f in opts["fields"] if f != "live_status"]})
                     for name, opts in super().get_fieldsets(request, obj)]
        if obj is None:
            return fieldsets
        return [("Live status", {"fields": ["live_status"]}), *fieldsets]

    @admin.display(description="live")
    def live(self, obj: Pool) -> str:
        state = pool_state(obj.name)
        if state is None:
            return "unknown"
        alive = len(state.live_workers)
        return (f"{alive} worker{'' if alive == 1 else 's'} · {state.running:,} running · "
                f"{state.queued:,} queued")

    @admin.display(description="now")
    def live_status(self, obj: Pool) -> SafeString:
        # pool_live.js re-reads the fragment every 5 s, so the page follows without a reload.
        return format_html('<div id="pool-live-box" data-url="{}">{}</div>',
                           reverse("admin:catalog_pool_live", args=[obj.pk]),
                           pool_status_html(obj))

    class Media:
        js = ["workers/pool_live.js"]

    def get_urls(self) -> list[Any]:
        live = path("<int:pk>/live/", self.admin_site.admin_view(self.live_view),
                    name="catalog_pool_live")
        return [live, *super().get_urls()]

    def live_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        pool = get_object_or_404(Pool, pk=pk)
        if not self.has_view_or_change_permission(request, pool):
            raise PermissionDenied
        response = HttpResponse(pool_status_html(pool))
        response["Cache-Control"] = "no-store"
        return response


def pool_status_html(pool: Pool) -> SafeString:
    state = pool_state(pool.name)
    if state is None:
        return format_html("<p>{}</p>", "Live status unavailable (Redis did not answer).")
    summary = format_html(
        '<p id="pool-live">Workers alive: <strong>{}</strong> · queued requests: <strong>{}'
        "</strong> · running sequences: <strong>{}</strong> of {} · KV cache: <strong>{}%"
        "</strong> ({} of {} tokens)</p>",
        len(state.live_workers), f"{state.queued:,}", f"{state.running:,}",
        f"{state.max_running:,}", state.kv_percent, f"{state.kv_used:,}", f"{state.kv_total:,}")
    rows = format_html_join("", "<tr><td>{}</td><td>{}</td><td>{} s ago</td><td>{}</td><td>{}</td>"
                            "<td>{}</td></tr>", (
        (w.worker_id, "alive" if w.alive else "missed heartbeats", w.seconds_since_beat,
         f"{w.running:,} / {w.max_running:,}", f"{w.waiting:,}",
         f"{w.kv_tokens_used:,} / {w.kv_tokens_total:,}") for w in state.workers))
    table = format_html(
        "<table><thead><tr><th>Worker</th><th>State</th><th>Last heartbeat</th><th>Running</th>"
        "<th>Waiting in engine</th><th>KV tokens</th></tr></thead><tbody>{}</tbody></table>",
        rows or format_html('<tr><td colspan="6">{}</td></tr>', "No worker has joined."))
    return format_html("{}{}<p class=\"help\">{} {}.</p>", summary, table,
                       "Read from the workers' heartbeats at",
                       f"{timezone.now():%H:%M:%S} UTC, every 5 seconds")
