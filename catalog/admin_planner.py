"""A read-only "capacity plan" section for the Pool admin's change page.

Wire it into ``PoolAdmin`` (``workers/admin.py``)::

    from catalog.admin_planner import CapacityPlanAdminMixin

    @admin.register(Pool)
    class PoolAdmin(CapacityPlanAdminMixin, admin.ModelAdmin):
        ...

The mixin adds a read-only ``capacity_plan`` field in its own collapsed fieldset: the design's
arithmetic for this pool's model (KV bytes per token, tokens in memory, sequences at the
average context, replicas for the demand, the cost of one long prompt) and the values to put
in ``kv_cache_tokens`` / ``max_sequences``. Accelerator size, decode rate and demand come from
``backend_settings["capacity"]`` (``catalog.capacity.POOL_PLAN_KEYS``), else the design's.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from catalog.capacity import KIB, PlanError, input_for_pool, plan


def capacity_plan_html(pool: Any) -> SafeString:
    """The plan as a small table; an explanation instead when the pool's inputs are unusable."""
    if pool is None or getattr(pool, "pk", None) is None or not getattr(pool, "model_id", None):
        return format_html("<p>{}</p>", "Save the pool to see its capacity plan.")
    try:
        result = plan(input_for_pool(pool))
    except PlanError as exc:
        return format_html("<p>No plan: {}</p>", str(exc))
    p = result.inputs
    rows = [
        ("KV cache per token", f"{result.kv_bytes_per_token:,} bytes "
                               f"({result.kv_bytes_per_token / KIB:g} KiB)"),
        ("Weights", f"{result.weights_bytes / 1e9:.1f} GB of {p.gpu_gb:g} GB"),
        ("KV budget", f"{result.kv_budget_bytes / 1e9:.1f} GB"),
        ("Tokens in memory", f"{result.tokens_in_memory:,}"),
        (f"Sequences at {p.avg_context:,} tokens", str(result.sequences)),
        ("By average context", ", ".join(f"{c:,}: {n}" for c, n in result.ladder.items())),
        ("Per replica", f"{result.replica_tokens_per_s:,.0f} output tokens/s "
                        f"at {p.decode_tps:g} per stream"),
        (f"Replicas for {p.demand_tpm:,.0f} tokens/min",
         f"{result.replicas} + {p.spare} spare = {result.total_replicas}"),
        (f"A {p.long_prompt:,}-token prompt", f"{result.long_prompt_bytes / 1e9:.1f} GB, "
         f"{result.long_prompt_share:.0%} of the budget, ~{result.long_prompt_displaces:.0f} "
         "sequences displaced"),
        ("Suggested pool settings", f"kv_cache_tokens={result.tokens_in_memory}, "
                                    f"max_sequences={result.sequences}"),
        *(("Warning", w) for w in result.warnings),
    ]
    body = format_html_join("", "<tr><th>{}</th><td>{}</td></tr>", rows)
    return format_html('<table class="capacity-plan">{}</table>', body)


class CapacityPlanAdminMixin:
    """Adds the read-only capacity plan to a ``ModelAdmin`` for ``Pool``."""

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        fields = list(super().get_readonly_fields(request, obj))  # type: ignore[misc]
        return [*fields, "capacity_plan"]

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets = list(super().get_fieldsets(request, obj))  # type: ignore[misc]
        for _, options in fieldsets:  # the default fieldset lists readonly fields too
            options["fields"] = [f for f in options["fields"] if f != "capacity_plan"]
        return [*fieldsets, ("Capacity plan", {"classes": ["collapse"],
                                               "fields": ["capacity_plan"]})]

    def capacity_plan(self, obj: Any) -> SafeString:
        return capacity_plan_html(obj)

    capacity_plan.short_description = "capacity plan"  # type: ignore[attr-defined]
