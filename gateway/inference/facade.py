"""The HTTP layer's one doorway to the serving core (``serving.submission``).

Builds what ``submit`` needs from the authenticated principal and the parsed request (the
tenant's and key's limits, sampling, the cache salt), so the consumers never assemble
accounting objects themselves.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.inference.responses import UsageCounts
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

__all__ = ["ErrorEvent", "Event", "FinishEvent", "Rejection", "Submission", "TokenEvent", "attach",
           "dumps", "submit_request", "usage_counts"]


def dumps(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def usage_counts(usage: UsageInfo) -> UsageCounts:
    return UsageCounts(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


async def submit_request(
    *, request_id: str, principal: Principal, pool: str, model: str,
    prompt_token_ids: Sequence[int], sampling: SamplingParams, stream: bool,
    adapter: str | None = None,
) -> Submission | Rejection:
    limits = AdmissionLimits.from_limits(principal.tenant_limits(model), principal.limits(model))
    return await submit(
        tenant_id=principal.tenant_id, key_id=principal.key_id, weight=principal.tenant_weight,
        model=model, pool=pool, prompt_token_ids=prompt_token_ids, sampling=sampling,
        limits=limits, stream=stream, request_id=request_id, cache_salt=principal.cache_salt,
        adapter=adapter,
    )
