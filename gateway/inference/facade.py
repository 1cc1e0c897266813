"""The HTTP layer's one doorway to the serving core (``serving.submission``).

Builds what ``submit`` needs from the authenticated principal and the parsed request (the
tenant's and key's limits, sampling, the cache salt), so the consumers never assemble
accounting objects themselves.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from django.conf import settings

from gateway.inference.responses import UsageCounts
from infra.redis_conn import get_async_redis
from serving import cells
from serving.admission import AdmissionLimits
from serving.submission import (
    ErrorEvent,
    Event,
    FinishEvent,
    Rejection,
    Submission,
    TokenEvent,
    UsageInfo,
    attach,
    submit,
)
from tenants.auth import Principal
from workers.engine.base import SamplingParams

__all__ = ["ErrorEvent", "Event", "FinishEvent", "Rejection", "Submission", "TokenEvent",
           "UsageInfo", "attach", "dumps", "submit_request", "usage_counts"]


def dumps(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def usage_counts(usage: UsageInfo) -> UsageCounts:
    return UsageCounts(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


async def submit_request(
    *, request_id: str, principal: Principal, pool: str, model: str,
    prompt_token_ids: Sequence[int], sampling: SamplingParams, stream: bool,
    adapter: str | None = None, end_user: str | None = None, trace: str | None = None,
) -> Submission | Rejection:
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
        adapter=adapter, context=_context(end_user, trace),
    )


def _context(end_user: str | None, trace: str | None) -> dict[str, str] | None:
    """What the request's hash carries beyond the charge: for its usage record and trace."""
    context = {"end_user": end_user, "trace": trace}
    return {k: v for k, v in context.items() if v} or None
