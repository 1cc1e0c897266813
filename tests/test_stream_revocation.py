"""Revoking a key or suspending a tenant ends its running streams within a second, with an
error event the official client raises, and the request is settled for what was generated.

Live processes: uvicorn and a Celery pool worker with the simulated engine (250 tokens/s, so a
2,000-token answer would run for 8 s), driven by the ``openai`` client.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import openai
import pytest

from tenants.models import ApiKey, Tenant
from tests import live_pool, rkeys
from tests.live_pool import HELLO, MODEL, SERVER_ENV, client, rid_of, tenant_key

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]
WORKER = "revoke-w1"


system, live = live_pool.fixtures(WORKER, SERVER_ENV)  # the processes, and each test's wait


def _stream_then(url: str, plain: str, act: Callable[[], None]) -> tuple[int, float, Any, str]:
    """Stream a long answer, ``act`` after 20 chunks; returns (chunks, seconds from act to the
    end of the stream, the error raised, the request id)."""
    stream = client(url, plain).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=2000, stream=True,
        extra_body={"ignore_eos": True})
    chunks, acted_at, rid = 0, 0.0, ""
    with pytest.raises(openai.APIError) as err:
        for chunk in stream:
            rid = rid or rid_of(chunk.id)
            chunks += 1
            if chunks == 20:
                act()
                acted_at = time.monotonic()
    return chunks, time.monotonic() - acted_at, err.value, rid


def test_revoking_the_key_ends_its_running_stream(live, redis_client) -> None:
    api_key, plain = tenant_key()
    chunks, took, error, rid = _stream_then(
        live["url"], plain, lambda: ApiKey.objects.filter(pk=api_key.pk).revoke())
    print(f"revocation to end of stream: {took:.3f} s after {chunks} chunks")
    assert took < 1.0, took
    assert "Incorrect API key" in str(error)
    record = rkeys.wait_usage_record(redis_client, rid)
    assert record["status"] == "cancelled"
    # Settled for what was generated: at least what we were sent, far from the 2,000 asked.
    assert chunks - 2 <= record["completion_tokens"] < 1000


def test_suspending_the_tenant_ends_its_running_stream(live, redis_client) -> None:
    api_key, plain = tenant_key()
    tenant = Tenant.objects.get(pk=api_key.tenant_id)
    _, took, error, rid = _stream_then(
        live["url"], plain, lambda: tenant.set_status(Tenant.Status.SUSPENDED))
    print(f"suspension to end of stream: {took:.3f} s")
    assert took < 1.0, took
    assert "suspended" in str(error)
    assert rkeys.wait_usage_record(redis_client, rid)["status"] == "cancelled"


def test_a_key_that_expires_mid_stream_ends_its_stream(live, redis_client) -> None:
    """Review 3, N11: expiry changes no epoch, so the watcher never re-checked the key and
    the stream ran on to its end after the key had expired."""
    from datetime import timedelta

    from django.utils import timezone

    from tests.factories import make_key, make_tenant

    expires = timezone.now() + timedelta(seconds=2)
    _, plain = make_key(make_tenant(), expires_at=expires)
    stream = client(live["url"], plain).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=2000, stream=True,
        extra_body={"ignore_eos": True})
    chunks, rid = 0, ""
    with pytest.raises(openai.APIError) as err:
        for chunk in stream:
            rid = rid or rid_of(chunk.id)
            chunks += 1
    late = (timezone.now() - expires).total_seconds()
    print(f"expiry to end of stream: {late:.3f} s after {chunks} chunks")
    assert late < 1.0, late
    assert "Incorrect API key" in str(err.value)
    assert rkeys.wait_usage_record(redis_client, rid)["status"] == "cancelled"


def test_other_keys_streams_carry_on(live, redis_client) -> None:
    """An unrelated revocation changes the epoch too: the stream is re-checked and goes on."""
    other, _ = tenant_key()
    _, plain = tenant_key()
    stream = client(live["url"], plain).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=300, stream=True,
        extra_body={"ignore_eos": True})
    finish = None
    for n, chunk in enumerate(stream):
        if n == 10:
            ApiKey.objects.filter(pk=other.pk).revoke()
        finish = chunk.choices[0].finish_reason if chunk.choices else finish
    assert finish == "length"
