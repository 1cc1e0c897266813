"""An identity-provider outage: backoff after failures, one fetch at a time, and API keys that
never wait on the provider (measured on a live gateway)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from tenants import oidc
from tenants.auth import AuthError
from tenants.models import IdentityProvider
from tests import procs
from tests.factories import make_key, make_tenant
from tests.oidc_provider import AUDIENCE, ISSUER, JwksServer, call, fresh_jwks, public_jwk, token


@pytest.fixture(scope="module")
def rsa_key():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture
def flaky(rsa_key, settings):
    with fresh_jwks([public_jwk(rsa_key, "k1", "RS256")]) as server:
        yield server


@pytest.fixture
def provider(db, redis_client, flaky):
    return IdentityProvider.objects.create(
        tenant=make_tenant("acme"), name="Acme SSO", issuer=ISSUER, audience=AUDIENCE,
        jwks_url=flaky.url, algorithms=["RS256"])


def _rejected(tok: str) -> None:
    with pytest.raises(AuthError):
        call(tok)


def test_after_a_failed_refetch_unknown_kids_back_off(provider, flaky, rsa_key, settings):
    """The provider goes down: ten tokens with unknown kids cost one fetch, not ten."""
    settings.OIDC_JWKS_MIN_REFRESH_SECONDS = 0.2
    call(token(rsa_key))
    assert flaky.fetches == 1
    time.sleep(0.3)  # the key set is now old enough to refresh on an unknown kid
    flaky.mode = "fail"
    for i in range(10):
        _rejected(token(rsa_key, kid=f"unknown-{i}"))
    assert flaky.fetches == 2  # one attempt, then backoff
    assert call(token(rsa_key)).tenant_id == provider.tenant_id  # the last good keys still work
    source = oidc.jwks_cache._source(flaky.url)
    assert source.failures == 1 and source.next_fetch_at() - time.monotonic() > 0.1
    time.sleep(source.next_fetch_at() - time.monotonic() + 0.05)
    flaky.mode = "ok"
    _rejected(token(rsa_key, kid="unknown-late"))  # after the backoff: one more attempt
    assert flaky.fetches == 3 and source.failures == 0


def test_backoff_doubles_while_the_provider_stays_down(provider, flaky, rsa_key, settings):
    settings.OIDC_JWKS_MIN_REFRESH_SECONDS = 1.0
    settings.OIDC_JWKS_CACHE_SECONDS = 300
    source = oidc.jwks_cache._source(flaky.url)
    gaps = []
    for failures in (1, 2, 3, 4):
        source.failures, source.attempted_at = failures, 100.0
        gaps.append(source.next_fetch_at() - 100.0)
    assert gaps == [1.0, 2.0, 4.0, 8.0]
    source.failures = 30
    assert source.next_fetch_at() - 100.0 == 300  # capped at the cache lifetime


def test_one_refetch_at_a_time(provider, flaky, rsa_key, settings):
    """Eight threads with unknown kids while the provider hangs: one fetch; the others answer
    from the keys we have at once instead of queueing behind it."""
    settings.OIDC_JWKS_MIN_REFRESH_SECONDS = 0.0
    settings.OIDC_HTTP_TIMEOUT_SECONDS = 1.5
    settings.AUTH_CACHE_SECONDS = 30.0  # threads find the registration cached (no DB rows)
    call(token(rsa_key))
    flaky.mode, flaky.hang_s = "hang", 1.0
    took: list[float] = []

    def one(i: int) -> None:
        start = time.monotonic()
        with contextlib.suppress(AuthError):
            call(token(rsa_key, kid=f"unknown-{i}"))
        took.append(time.monotonic() - start)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert flaky.fetches == 2  # the priming fetch and exactly one refetch
    assert sorted(took)[-2] < 0.5  # only the thread that fetched waited for the provider


def test_a_trickling_provider_is_cut_off_at_the_deadline(provider, flaky, rsa_key, settings):
    """Review 3, N7: a JWKS trickled a byte every 0.2 s; each read came in time, so the old
    per-read timeout never fired and the fetch held an identity thread for minutes."""
    settings.OIDC_HTTP_TIMEOUT_SECONDS = 1.0
    flaky.mode = "trickle"
    started = time.monotonic()
    _rejected(token(rsa_key))
    assert time.monotonic() - started < 2.0
    assert oidc.jwks_cache._source(flaky.url).failures == 1


def test_one_slow_provider_holds_at_most_two_identity_threads(provider, flaky, rsa_key,
                                                              settings):
    """Six tokens of a provider we have no keys for, while its JWKS trickles: one thread
    fetches, one waits, the other four are refused at once instead of each holding one of the
    shared identity threads."""
    settings.OIDC_HTTP_TIMEOUT_SECONDS = 1.0
    settings.AUTH_CACHE_SECONDS = 30.0  # threads find the registration cached (no DB rows)
    call(token(rsa_key))
    oidc.jwks_cache.clear()  # ... but no keys: each thread needs the provider's JWKS
    flaky.mode = "trickle"
    took: list[float] = []

    def one() -> None:
        start = time.monotonic()
        with contextlib.suppress(AuthError):
            call(token(rsa_key))
        took.append(time.monotonic() - start)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    slow = [t for t in took if t > 0.5]
    assert len(took) == 6 and 1 <= len(slow) <= oidc.MAX_BLOCKED_PER_PROVIDER, took
    assert flaky.fetches == 2  # the priming fetch and one trickled fetch
    assert max(took) < 3.5


@pytest.mark.integration
@pytest.mark.django_db(transaction=True)
def test_a_hanging_provider_does_not_delay_api_key_requests(redis_client, rsa_key):
    """Live gateway: JWTs whose JWKS fetch hangs for 3 s run alongside API-key requests that
    miss the auth cache (AUTH_CACHE_SECONDS=0: every one is a database lookup). Before, the two
    shared one thread and the API-key requests waited the full 3 s."""
    hang = JwksServer([public_jwk(rsa_key, "k1", "RS256")])
    hang.mode, hang.hang_s = "hang", 3.0
    tenant = make_tenant("acme")
    IdentityProvider.objects.create(tenant=tenant, name="Acme SSO", issuer=ISSUER,
                                    audience=AUDIENCE, jwks_url=hang.url, algorithms=["RS256"])
    _, plaintext = make_key(tenant, name="fast")
    server, url = procs.start_uvicorn(env={
        "AUTH_CACHE_SECONDS": "0", "OIDC_HTTP_TIMEOUT_SECONDS": "3",
        "OIDC_JWKS_MIN_REFRESH_SECONDS": "0"})
    try:
        procs.wait_for_http(url + "/healthz", server)

        async def scenario() -> tuple[float, list[float]]:
            async with httpx.AsyncClient(base_url=url, timeout=20) as client:
                key_headers = {"Authorization": f"Bearer {plaintext}"}
                assert (await client.get("/v1/models", headers=key_headers)).status_code == 200
                jwt_calls = [asyncio.create_task(client.get(
                    "/v1/models", headers={"Authorization": f"Bearer {token(rsa_key)}"}))
                    for _ in range(3)]
                while hang.fetches == 0:  # the provider is now holding a fetch open
                    await asyncio.sleep(0.02)
                timings = []
                for _ in range(5):
                    start = time.monotonic()
                    answer = await client.get("/v1/models", headers=key_headers)
                    timings.append(time.monotonic() - start)
                    assert answer.status_code == 200
                jwt_start = time.monotonic()
                await asyncio.gather(*jwt_calls)
                return time.monotonic() - jwt_start, timings

        _, timings = asyncio.run(scenario())
        print(f"API-key requests while the JWKS fetch hangs: {[round(t, 3) for t in timings]} s")
        assert max(timings) < 1.0, (timings, server.logs()[-2000:])
    finally:
        server.stop()
        hang.close()
