"""Effective limits for one request, and the checks that keep quotas possible.

Resolution, most specific last:

1. ``QUOTA_DEFAULTS`` (platform defaults);
2. the tenant's default Quota row (``model`` empty): its non-null fields;
3. the tenant's Quota row for the requested model: its non-null fields;
4. the key's caps (``ApiKey.input_tpm`` ...): ``min(tenant value, key cap)``.

A burst left empty means one minute of the rate. A layer that sets a rate without a burst also
resets the burst to that default, so an override that lowers a rate tenfold does not inherit a
burst sized for the old rate. A key cap on a rate also caps the burst: the key's own bucket
never holds more than a minute of the key's rate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from django.core.exceptions import ValidationError

if TYPE_CHECKING:
    from catalog.models import ServedModel
    from tenants.models import ApiKey, Tenant

LIMIT_FIELDS = (
    "input_tpm",
    "output_tpm",
    "concurrent_requests",
    "open_streams",
    "max_output_tokens",
)
QUOTA_FIELDS = (
    *LIMIT_FIELDS,
    "input_burst",
    "output_burst",
    "max_context_tokens",
    "ttft_deadline_s",
    "total_deadline_s",
)
QUOTA_DEFAULTS = {
    "input_tpm": 200_000,
    "output_tpm": 100_000,
    "input_burst": None,  # None: one minute's worth of the rate
    "output_burst": None,
    "concurrent_requests": 32,
    "open_streams": 32,
    "max_context_tokens": 8192,
    "max_output_tokens": 4096,
    "ttft_deadline_s": 30.0,
    "total_deadline_s": 600.0,
}

Number = int | float
QuotaValues = Mapping[str, Number | None]
_RATE_BURST = (("input_tpm", "input_burst"), ("output_tpm", "output_burst"))
_FLOAT_FIELDS = {"ttft_deadline_s", "total_deadline_s"}


@dataclass(frozen=True)
class Limits:
    input_tpm: int
    output_tpm: int
    input_burst: int
    output_burst: int
    concurrent_requests: int
    open_streams: int
    max_context_tokens: int
    max_output_tokens: int
    ttft_deadline_s: float
    total_deadline_s: float

    def as_dict(self) -> dict[str, Number]:
        return asdict(self)


def row_values(row: object | None) -> dict[str, Number | None]:
    """The quota fields of a Quota row (or anything with those attributes); None -> all unset."""
    return {f: getattr(row, f, None) for f in QUOTA_FIELDS} if row is not None else {}


def key_caps(key: ApiKey | None) -> dict[str, int]:
    return {f: getattr(key, f) for f in LIMIT_FIELDS if getattr(key, f, None) is not None}


def merge(*layers: QuotaValues | None) -> dict[str, Number | None]:
    """Platform defaults overlaid by each layer's non-null fields, bursts left possibly None."""
    values: dict[str, Number | None] = dict(QUOTA_DEFAULTS)
    for layer in layers:
        if not layer:
            continue
        for rate, burst in _RATE_BURST:
            if layer.get(rate) is not None and layer.get(burst) is None:
                values[burst] = None  # a new rate brings its own one-minute burst
        values.update({f: layer[f] for f in QUOTA_FIELDS if layer.get(f) is not None})
    return values


def _with_bursts(values: Mapping[str, Number | None]) -> dict[str, Number]:
    filled = dict(values)
    for rate, burst in _RATE_BURST:
        if filled.get(burst) is None:
            filled[burst] = filled[rate]
    return filled  # type: ignore[return-value]


def resolve(
    default: QuotaValues | None, override: QuotaValues | None = None,
    caps: Mapping[str, int] | None = None,
) -> Limits:
    values = _with_bursts(merge(default, override))
    for field, cap in (caps or {}).items():
        values[field] = min(values[field], cap)
    for rate, burst in _RATE_BURST:
        values[burst] = min(values[burst], values[rate]) if rate in (caps or {}) else values[burst]
    return Limits(**values)  # type: ignore[arg-type]


def quota_table(tenant: Tenant) -> dict[str | None, dict[str, Number | None]]:
    """The tenant's quota rows by model name (None = default), for resolving without the DB."""
    rows = tenant.quotas.select_related("model")
    return {(row.model.name if row.model else None): row_values(row) for row in rows}


def effective_limits(
    tenant: Tenant, model: ServedModel | str | None = None, key: ApiKey | None = None
) -> Limits:
    table = quota_table(tenant)
    model_name = model if isinstance(model, str) or model is None else model.name
    return resolve(table.get(None), table.get(model_name), key_caps(key))


# --- validation: used by Quota.clean, the admin forms and the management commands -----------

def field_errors(values: QuotaValues, fields: Iterable[str]) -> dict[str, str]:
    errors = {}
    for field in fields:
        value = values.get(field)
        if value is None:
            continue
        label = field.replace("_", " ")
        if field not in _FLOAT_FIELDS and value != int(value):
            errors[field] = f"{label} must be a whole number, got {value}."
        elif value <= 0:
            errors[field] = f"{label} must be greater than zero, got {value}."
    return errors


def quota_errors(values: QuotaValues, *, base: QuotaValues | None = None) -> dict[str, str]:
    """Why a quota row (laid over ``base``, the tenant default for an override) is impossible."""
    errors = field_errors(values, QUOTA_FIELDS)
    if errors:
        return errors
    merged = _with_bursts(merge(base, values))
    if merged["ttft_deadline_s"] > merged["total_deadline_s"]:
        errors["ttft_deadline_s"] = (
            f"The time-to-first-token deadline ({merged['ttft_deadline_s']:g} s) cannot exceed "
            f"the total deadline ({merged['total_deadline_s']:g} s)."
        )
    if merged["max_output_tokens"] > merged["max_context_tokens"]:
        errors["max_output_tokens"] = (
            f"Max output tokens ({merged['max_output_tokens']}) cannot exceed the max context "
            f"({merged['max_context_tokens']}): output is part of the context."
        )
    # A request is charged up front; a bucket smaller than the largest allowed request could
    # never admit it, so that request would get 429 forever.
    if merged["output_burst"] < merged["max_output_tokens"]:
        errors.setdefault("output_burst", (
            f"The output burst ({merged['output_burst']} tokens; empty = one minute of output "
            f"tokens per minute) is below max output tokens ({merged['max_output_tokens']}): "
            "a request at the maximum could never be admitted."
        ))
    if merged["input_burst"] < merged["max_context_tokens"] - merged["max_output_tokens"]:
        errors.setdefault("input_burst", (
            f"The input burst ({merged['input_burst']} tokens; empty = one minute of input "
            f"tokens per minute) is below the largest prompt the max context allows "
            f"({merged['max_context_tokens'] - merged['max_output_tokens']}): such a prompt "
            "could never be admitted."
        ))
    return errors


def validate_quota(values: QuotaValues, *, base: QuotaValues | None = None) -> None:
    errors = quota_errors(values, base=base)
    if errors:
        raise ValidationError(errors)


def key_cap_errors(
    caps: QuotaValues, table: Mapping[str | None, QuotaValues]
) -> dict[str, str]:
    """Per-key caps must be positive and no higher than the most the tenant has for any model."""
    errors = field_errors(caps, LIMIT_FIELDS)
    default = table.get(None)
    resolved = [merge(default, row) for name, row in table.items() if name is not None]
    resolved.append(merge(default))
    for field in LIMIT_FIELDS:
        cap = caps.get(field)
        if cap is None or field in errors:
            continue
        ceilings = [v for values in resolved if (v := values[field]) is not None]
        if not ceilings:
            continue  # no model of the tenant limits this field
        ceiling = max(ceilings)
        if cap > ceiling:
            errors[field] = (
                f"The key's {field.replace('_', ' ')} ({cap}) is above the tenant's ({ceiling}); "
                "a key can only narrow its tenant's limits."
            )
    return errors


def validate_key_caps(tenant: Tenant, caps: QuotaValues) -> None:
    errors = key_cap_errors(caps, quota_table(tenant))
    if errors:
        raise ValidationError(errors)
