"""Shared fixtures. Tests run against real PostgreSQL and real Redis (see scripts/test.sh)."""

from __future__ import annotations

import pytest

# Real vLLM (the tiny model, one engine and one `vllm serve` per run): tests/vllm_fixtures.py.
pytest_plugins = ["tests.vllm_fixtures"]


@pytest.fixture
def redis_client(settings):
    """A clean Redis for one test. The test DB index is dedicated to tests, so flushing is safe."""
    from gateway.redis_conn import get_redis

    client = get_redis()
    client.flushdb()
    yield client
    client.flushdb()
