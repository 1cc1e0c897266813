"""A principal's request into the serving core: ``serving.submission.submit`` with the limits,
weight and cache salt of the authenticated principal (a tenant split across cells gets this
cell's share). The consumers take everything else (events, attach) from ``serving.submission``
itself: there is one facade, that one.
"""

from __future__ import annotations

from collections.abc import Sequence

from django.conf import settings

from gateway.inference.prices import unit_prices
from infra.redis_conn import get_async_redis
from serving import cells
from serving.admission import AdmissionLimits, RateLimitInfo, Reason
from serving.submission import Rejection, Submission, submit
from serving.wire import SamplingParams
from tenants.auth import Principal


async def submit_request(
    *, request_id: str, principal: Principal, pool: str, model: str,
    prompt_token_ids: Sequence[int], sampling: SamplingParams, stream: bool,
    adapter: str | None = None, end_user: str = "", trace: str | None = None, shape: str = "",
) -> Submission | Rejection:
    if principal.over_budget:
        return over_budget(request_id)
    rules = principal.budgets.rules(end_user)
    prices = await unit_prices(model) if any(r.money for r in rules) else None
    limits = AdmissionLimits.from_limits(principal.tenant_limits(model), principal.limits(model))
    split = bool(settings.CELL) and len(principal.tenant_cells) > 1
    if split:
        # A tenant served in several cells: this cell enforces its share of the tenant's default
        # quota (serving.cells, docs/adr/0019), and counts the demand that moves the shares.
        limits = cells.split_limits(limits, cells.quota_of(principal.tenant_limits(None)),
                                    len(principal.tenant_cells), settings.CELL_SHARE_FLOOR)
        await cells.record_demand_async(get_async_redis(), principal.tenant_id,
                                        len(prompt_token_ids) + sampling.max_tokens * sampling.n)
    return await submit(
        tenant_id=principal.tenant_id, key_id=principal.key_id, weight=principal.tenant_weight,
        model=model, pool=pool, prompt_token_ids=prompt_token_ids, sampling=sampling,
        limits=limits, stream=stream, request_id=request_id, cache_salt=principal.cache_salt,
        adapter=adapter, budget_rules=rules, prices=prices,
        context=_context(end_user, trace, principal.project_id, shape),
    )


def over_budget(request_id: str) -> Rejection:
    """A key a spend alert's hard cap stopped: 429 insufficient_quota, nothing admitted."""
    return Rejection(request_id, Reason.INSUFFICIENT_QUOTA, "key", 0,
                     RateLimitInfo(-1, -1, -1, -1, 0.0),
                     message="This API key is over budget: a spend alert's hard cap stopped "
                             "it. A tenant owner can raise the cap or resume the key.")


def _context(end_user: str, trace: str | None, project: int | None,
             shape: str = "") -> dict[str, str] | None:
    """What the request's hash carries beyond the charge: for its usage record, the request
    log and the trace (ids only, never content), and the stream's shape for a resume."""
    context = {"end_user": end_user, "trace": trace,
               "project": "" if project is None else str(project), "shape": shape}
    return {k: v for k, v in context.items() if v} or None
