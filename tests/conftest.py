"""Shared fixtures. Tests run against real PostgreSQL and real Redis (see scripts/test.sh)."""

from __future__ import annotations

import pytest


@pytest.fixture
def redis_client(settings):
    """A clean Redis for one test. The test DB index is dedicated to tests, so flushing is safe."""
    from infra.redis_conn import get_redis

    client = get_redis()
    client.flushdb()
    yield client
    client.flushdb()
