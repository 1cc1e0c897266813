"""What each tenant role may do, in one table used by the portal pages and the API.

owner: everything in the tenant. member: their own keys and the usage of those keys, the
playground. billing: usage and reports for the whole tenant, spend alerts.
"""

from __future__ import annotations

OWNER, MEMBER, BILLING = "owner", "member", "billing"

CAN: dict[str, frozenset[str]] = {
    "overview": frozenset({OWNER, MEMBER, BILLING}),  # getting started: base URL, models, prices
    "keys": frozenset({OWNER, MEMBER}),  # a member sees and manages only the keys they made
    "all_keys": frozenset({OWNER}),
    "usage": frozenset({OWNER, MEMBER, BILLING}),
    "all_usage": frozenset({OWNER, BILLING}),
    "quotas": frozenset({OWNER, MEMBER, BILLING}),
    "reports": frozenset({OWNER, BILLING}),
    "alerts": frozenset({OWNER, BILLING}),
    "members": frozenset({OWNER}),  # the portal page and the API
    "content_logging": frozenset({OWNER}),
    "response_cache": frozenset({OWNER}),  # stores answers: the owner's decision, like logging
    "tokens": frozenset({OWNER}),
    "playground": frozenset({OWNER, MEMBER}),
    "projects": frozenset({OWNER, MEMBER, BILLING}),  # read; owners change them
    "budgets": frozenset({OWNER, BILLING}),  # read with spend; owners change them
    "manage_budgets": frozenset({OWNER}),  # budgets, projects, resuming a key over budget
    "fallbacks": frozenset({OWNER, MEMBER}),  # the tenant's own fallback order per model
    "manage_fallbacks": frozenset({OWNER}),
}


def can(role: str | None, capability: str) -> bool:
    return role is not None and role in CAN[capability]


def capabilities(role: str | None) -> dict[str, bool]:
    return {name: can(role, name) for name in CAN}
