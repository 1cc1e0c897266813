"""Shared fixtures. Tests run against real PostgreSQL and real Redis (see scripts/test.sh)."""

from __future__ import annotations

import pytest


@pytest.fixture
def redis_client(settings):
    """A clean Redis for one test. The test DB index is dedicated to tests, so flushing is safe."""
    from gateway.redis_conn import get_redis

    client = get_redis()
    client.flushdb()
    yield client
    client.flushdb()


# Tests make many users; PBKDF2 at its production cost would spend seconds per test on hashing.
FAST_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True, scope="session")
def fast_passwords():
    """One fast password hasher for the whole run (never in production settings)."""
    from django.test import override_settings

    with override_settings(PASSWORD_HASHERS=FAST_HASHERS):
        yield
