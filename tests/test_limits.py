"""Effective limits (default quota, model override, key caps) and the impossible-quota checks."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from tenants.limits import (
    Limits,
    effective_limits,
    key_cap_errors,
    quota_errors,
    resolve,
    validate_key_caps,
    validate_quota,
)
from tenants.models import QUOTA_DEFAULTS, QUOTA_FIELDS, Quota
from tests.factories import make_key, make_model, make_tenant


def test_platform_defaults_with_one_minute_bursts():
    limits = resolve(None)
    assert isinstance(limits, Limits)
    for field in QUOTA_FIELDS:
        if QUOTA_DEFAULTS[field] is not None:
            assert getattr(limits, field) == QUOTA_DEFAULTS[field]
    assert limits.input_burst == QUOTA_DEFAULTS["input_tpm"]
    assert limits.output_burst == QUOTA_DEFAULTS["output_tpm"]


def test_override_fills_only_its_non_null_fields():
    default = {"input_tpm": 1000, "input_burst": 4000, "max_context_tokens": 2000,
               "max_output_tokens": 500}
    override = {"max_context_tokens": 4000, "output_tpm": None}
    limits = resolve(default, override)
    assert (limits.input_tpm, limits.input_burst) == (1000, 4000)
    assert limits.max_context_tokens == 4000
    assert limits.max_output_tokens == 500
    assert limits.output_tpm == QUOTA_DEFAULTS["output_tpm"]


def test_a_new_rate_without_a_burst_gets_its_own_one_minute_burst():
    limits = resolve({"input_tpm": 100_000, "input_burst": 400_000}, {"input_tpm": 10_000})
    assert (limits.input_tpm, limits.input_burst) == (10_000, 10_000)


def test_key_caps_apply_as_min_and_cap_the_burst():
    default = {"input_tpm": 10_000, "input_burst": 50_000, "concurrent_requests": 8}
    caps = {"input_tpm": 2_000, "concurrent_requests": 20, "max_output_tokens": 100}
    limits = resolve(default, None, caps)
    assert limits.input_tpm == 2_000
    assert limits.input_burst == 2_000  # the key's bucket holds a minute of the key's rate
    assert limits.concurrent_requests == 8  # a cap above the tenant's changes nothing
    assert limits.max_output_tokens == 100
    assert limits.output_burst == QUOTA_DEFAULTS["output_tpm"]


@pytest.mark.django_db
def test_effective_limits_reads_the_tenant_rows():
    tenant = make_tenant(input_tpm=30_000)
    model = make_model("sim-big")
    Quota.objects.create(tenant=tenant, model=model, input_tpm=60_000, max_output_tokens=64)
    key, _ = make_key(tenant, input_tpm=45_000)
    assert effective_limits(tenant).input_tpm == 30_000
    assert effective_limits(tenant, model).input_tpm == 60_000
    assert effective_limits(tenant, "sim-big", key).input_tpm == 45_000
    assert effective_limits(tenant, "sim-big", key).max_output_tokens == 64
    assert effective_limits(tenant, "unknown-model", key).input_tpm == 30_000


@pytest.mark.parametrize("field,value,needle", [
    ("input_tpm", -5, "greater than zero"),
    ("output_tpm", 0, "greater than zero"),
    ("input_burst", 0, "greater than zero"),
    ("concurrent_requests", -1, "greater than zero"),
    ("max_context_tokens", 1.5, "whole number"),
    ("ttft_deadline_s", 0, "greater than zero"),
    ("total_deadline_s", -3.0, "greater than zero"),
])
def test_negative_zero_and_fractional_values_are_rejected(field, value, needle):
    errors = quota_errors({field: value})
    assert needle in errors[field]
    assert field.replace("_", " ") in errors[field]


def test_first_token_deadline_cannot_exceed_total():
    errors = quota_errors({"ttft_deadline_s": 60, "total_deadline_s": 30})
    assert "cannot exceed the total deadline" in errors["ttft_deadline_s"]
    # The same check against the default row, for an override that sets only one side.
    errors = quota_errors({"ttft_deadline_s": 90}, base={"total_deadline_s": 60})
    assert "ttft_deadline_s" in errors


def test_bursts_too_small_for_the_largest_request_are_rejected():
    errors = quota_errors({"output_tpm": 1000, "max_output_tokens": 4096})
    assert "could never be admitted" in errors["output_burst"]
    errors = quota_errors({"input_tpm": 1000, "max_context_tokens": 8192,
                           "max_output_tokens": 100})
    assert "could never be admitted" in errors["input_burst"]
    assert quota_errors({"output_tpm": 1000, "max_output_tokens": 1000,
                         "input_tpm": 2000, "max_context_tokens": 3000}) == {}


def test_max_output_cannot_exceed_max_context():
    errors = quota_errors({"max_context_tokens": 1000, "max_output_tokens": 2000})
    assert "cannot exceed the max context" in errors["max_output_tokens"]


def test_valid_quota_passes_and_validate_raises_with_fields():
    validate_quota({"input_tpm": 500_000, "ttft_deadline_s": 2, "total_deadline_s": 60})
    with pytest.raises(ValidationError) as err:
        validate_quota({"open_streams": 0})
    assert set(err.value.message_dict) == {"open_streams"}


def test_key_caps_above_the_tenant_are_rejected():
    table = {None: {"input_tpm": 10_000}, "sim-big": {"input_tpm": 50_000}}
    assert key_cap_errors({"input_tpm": 50_000}, table) == {}  # the override allows it
    errors = key_cap_errors({"input_tpm": 50_001, "open_streams": 33}, table)
    assert "above the tenant's (50000)" in errors["input_tpm"]
    assert "above the tenant's (32)" in errors["open_streams"]  # platform default applies
    assert "greater than zero" in key_cap_errors({"output_tpm": 0}, table)["output_tpm"]


@pytest.mark.django_db
def test_quota_model_clean_uses_the_limits_checks():
    tenant = make_tenant(total_deadline_s=30)
    model = make_model()
    override = Quota(tenant=tenant, model=model, ttft_deadline_s=45)
    with pytest.raises(ValidationError) as err:
        override.full_clean()
    assert "ttft_deadline_s" in err.value.message_dict
    with pytest.raises(ValidationError):
        validate_key_caps(tenant, {"max_output_tokens": 10**6})
