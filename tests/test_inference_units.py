"""Routing, sizing and idempotency, one module at a time (real Redis, no subprocesses)."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.inference import idempotency, pools
from gateway.inference.errors import ApiError
from gateway.inference.pools import Catalog, ModelInfo, PoolInfo, PoolLoad
from gateway.inference.requests import InferenceRequest
from gateway.inference.sizing import size_request
from tenants.limits import resolve
from tests import rkeys

MODEL = ModelInfo("m", None, max_model_len=100, created=0)
OTHER = ModelInfo("other", None, max_model_len=100, created=0)


def catalog(*specs: tuple[str, str, int | None, ModelInfo]) -> Catalog:
    return Catalog({"m": MODEL, "other": OTHER},
                   tuple(PoolInfo(n, region, ded, model) for n, region, ded, model in specs))


def test_a_dedicated_pool_comes_first_and_alone() -> None:
    cat = catalog(("shared", "eu", None, MODEL), ("mine", "us", 7, MODEL),
                  ("theirs", "eu", 8, MODEL))
    assert [p.name for p in pools.candidates(cat, "m", 7, "eu")] == ["mine"]


def test_shared_pools_only_in_the_tenant_region_and_for_the_model() -> None:
    cat = catalog(("eu-1", "eu", None, MODEL), ("us-1", "us", None, MODEL),
                  ("eu-2", "eu", None, MODEL), ("eu-other", "eu", None, OTHER),
                  ("someone-elses", "eu", 8, MODEL))
    assert [p.name for p in pools.candidates(cat, "m", 7, "eu")] == ["eu-1", "eu-2"]
    assert pools.candidates(cat, "m", 7, "ap") == []


def test_load_prefers_spare_capacity_and_avoids_pools_without_workers() -> None:
    assert PoolLoad(queued=0, in_flight=8, capacity=16).score < PoolLoad(4, 8, 16).score
    assert PoolLoad(0, 0, 0).score == float("inf")


@pytest.mark.django_db(transaction=True)  # the catalog is read from another thread
def test_choose_pool_by_published_load(redis_client) -> None:
    from tests.factories import make_model, make_pool

    model = make_model("routed")
    make_pool(model, name="busy")
    make_pool(model, name="idle")
    now = time.time()
    for pool, wid, in_flight in (("busy", "w-busy", 15), ("idle", "w-idle", 1)):
        redis_client.zadd(rkeys.workers_key(pool), {wid: now})
        redis_client.hset(rkeys.worker_key(pool, wid, "load"),
                          mapping={"in_flight": in_flight, "max_running": 16})
    pools.forget_catalog()

    async def pick() -> str:
        return (await pools.choose_pool("routed", 1, "local", frozenset())).name

    assert asyncio.run(pick()) == "idle"
    redis_client.zadd(rkeys.workers_key("idle"), {"w-idle": now - 3600})  # its worker died
    pools.forget_catalog()
    assert asyncio.run(pick()) == "busy"
    pools.forget_catalog()


def limits(**fields: int) -> object:
    return resolve({"max_context_tokens": 50, "max_output_tokens": 20, **fields})


def req(max_tokens: int | None) -> InferenceRequest:
    return InferenceRequest(kind="completion", model="m", prompt="x", max_tokens=max_tokens)


def test_missing_max_tokens_is_the_rest_of_the_window_capped() -> None:
    assert size_request(req(None), [1] * 40, MODEL, limits()).max_tokens == 10
    assert size_request(req(None), [1] * 5, MODEL, limits()).max_tokens == 20
    small = ModelInfo("m", None, max_model_len=30, created=0)
    assert size_request(req(None), [1] * 25, small, limits()).max_tokens == 5


@pytest.mark.parametrize(("prompt", "max_tokens", "code"), [
    (50, None, "context_length_exceeded"),  # no room for even one output token
    (49, None, None),
    (40, 11, "context_length_exceeded"),
    (40, 10, None),
    (5, 21, "max_tokens_exceeded"),
    (0, None, "invalid_value"),
])
def test_sizing_limits(prompt: int, max_tokens: int | None, code: str | None) -> None:
    if code is None:
        size_request(req(max_tokens), [1] * prompt, MODEL, limits())
        return
    with pytest.raises(ApiError) as err:
        size_request(req(max_tokens), [1] * prompt, MODEL, limits())
    assert (err.value.status, err.value.code) == (400, code)


def test_body_hash_ignores_key_order_and_spacing() -> None:
    assert idempotency.body_hash({"a": 1, "b": [1, 2]}) == idempotency.body_hash(
        {"b": [1, 2], "a": 1})
    assert idempotency.body_hash({"a": 1}) != idempotency.body_hash({"a": 2})


@pytest.mark.parametrize("bad", ["", "x" * 256, "tab\there", "new\nline"])
def test_idempotency_keys_are_checked(bad: str) -> None:
    with pytest.raises(ApiError):
        idempotency.checked_key(bad)


def test_idempotency_states(redis_client) -> None:
    async def scenario() -> None:
        first = await idempotency.begin(1, "k", "h1", 30)
        assert isinstance(first, idempotency.Claim)
        with pytest.raises(ApiError) as busy:
            await idempotency.begin(1, "k", "h1", 30)
        assert busy.value.status == 409
        with pytest.raises(ApiError) as changed:
            await idempotency.begin(1, "k", "h2", 30)
        assert changed.value.status == 422
        assert isinstance(await idempotency.begin(2, "k", "h2", 30), idempotency.Claim)
        stranger = idempotency.Claim(first.redis_key, "not-the-owner")
        await stranger.store(200, b"forged")  # only the owner may store
        with pytest.raises(ApiError):
            await idempotency.begin(1, "k", "h1", 30)
        await first.store(200, b'{"ok":1}')
        replay = await idempotency.begin(1, "k", "h1", 30)
        assert replay == idempotency.Replay(200, b'{"ok":1}')
        assert 0 < await redis_client_ttl(first.redis_key) <= idempotency.RETENTION_S

    async def redis_client_ttl(name: str) -> int:
        return int(redis_client.ttl(name))

    asyncio.run(scenario())


def test_only_one_of_many_concurrent_begins_wins(redis_client) -> None:
    async def race() -> list[object]:
        return await asyncio.gather(*(idempotency.begin(1, "same", "h", 30) for _ in range(20)),
                                    return_exceptions=True)

    outcomes = asyncio.run(race())
    assert sum(isinstance(o, idempotency.Claim) for o in outcomes) == 1
    assert all(isinstance(o, ApiError) and o.status == 409 for o in outcomes
               if not isinstance(o, idempotency.Claim))


def test_an_abandoned_key_can_be_used_again(redis_client) -> None:
    async def scenario() -> object:
        claim = await idempotency.begin(1, "retry", "h", 30)
        assert isinstance(claim, idempotency.Claim)
        await claim.abandon()
        return await idempotency.begin(1, "retry", "h", 30)

    assert isinstance(asyncio.run(scenario()), idempotency.Claim)


def test_failures_map_to_retryable_503_only_before_any_token() -> None:
    from gateway.inference.consumers import failure
    from serving.submission import ErrorEvent, FinishEvent, UsageInfo

    lost = ErrorEvent("worker_lost", "gone", retryable=True)
    early = failure(lost, tokens_sent=0)
    assert (early.status, early.code, early.headers["retry-after"]) == (503, "worker_lost", "1")
    assert failure(lost, tokens_sent=3).status == 503
    assert failure(ErrorEvent("deadline_exceeded", "slow", retryable=False), 5).status == 504
    assert failure(ErrorEvent("engine_error", "bad", retryable=False), 0).status == 500
    aborted = failure(FinishEvent("abort", UsageInfo(1, 0), "1-0"), 0)
    assert (aborted.status, aborted.code) == (503, "request_cancelled")


def test_an_engine_refusal_is_a_400_naming_its_parameter() -> None:
    """The parameter travels from the worker's event (``p``) to the client's error."""
    from gateway.inference.consumers import failure
    from serving import transport
    from serving.submission import _event

    fields = transport.error_event("engine_refused", "too wide", retryable=False,
                                   param="dimensions")
    [event] = _event(transport.StreamEvent("1-0", fields))
    refused = failure(event, tokens_sent=0)
    assert (refused.status, refused.code, refused.param) == (400, "engine_refused",
                                                             "dimensions")
    assert refused.payload()["error"]["param"] == "dimensions"
    plain = transport.error_event("engine_refused", "empty prompt", retryable=False)
    assert "p" not in plain
    assert failure(_event(transport.StreamEvent("2-0", plain))[0], 0).param is None


def test_rejections_map_to_429_with_the_accounting_headers() -> None:
    from gateway.inference.consumers import rejection_error
    from serving.admission import RateLimitInfo
    from serving.submission import Rejection

    info = RateLimitInfo(4, 0, 1000, 10, 12.5)
    busy = rejection_error(Rejection("r", "input_tokens", "tenant", 7, info, "slow down"))
    assert (busy.status, busy.code, busy.type) == (429, "rate_limit_exceeded", "rate_limit_error")
    assert busy.headers["retry-after"] == "7"
    assert busy.headers["x-ratelimit-remaining-tokens"] == "10"
    huge = rejection_error(Rejection("r", "too_large", "tenant:output_tokens", 0, info, "big"))
    assert (huge.status, huge.code) == (429, "request_too_large")
    assert huge.headers["x-should-retry"] == "false" and "retry-after" not in huge.headers


def test_overload_sheds_the_tenant_over_its_share_lowest_tier_first(redis_client) -> None:
    from gateway.inference import overload
    from serving.wfq import Wfq

    wfq = Wfq()
    redis_client.zadd(rkeys.workers_key("p"), {"w1": time.time()})  # one live worker, 2 slots

    def queue(tenant: str, n: int, weight: float, output: int) -> None:
        for i in range(n):
            wfq.enqueue("p", tenant, f"{tenant}-{time.monotonic_ns()}-{i}", weight=weight,
                        prompt_tokens=10, max_output_tokens=output, kv_tokens=output + 10)

    def shed(tenant: str) -> bool:
        try:
            asyncio.run(overload.check("p", 2, tenant))
        except ApiError as err:
            assert (err.status, err.code) == (503, "overloaded")
            assert int(err.headers["retry-after"]) >= 1
            return True
        return False

    queue("small", 1, 1.0, 300)
    queue("flood", 5, 1.0, 20_000)  # 6 queued, within 4 x 2 slots
    assert not shed("flood") and not shed("small")  # not overloaded yet
    queue("flood", 20, 1.0, 20_000)
    assert shed("flood")  # far over its share
    assert not shed("small")  # within its share: never shed while another exceeds its own
    # The same backlog in work is a bigger virtual backlog for a lower tier (weight 0.2), so at
    # a level of work where a weight-1 tenant still passes, the lower tier is refused first.
    # 30,000 output tokens: 60,010 units of tokens plus 18,012 of KV time (ADR 0017), below the
    # 100,000 threshold at weight 1 and five times above it at weight 0.2.
    queue("gold", 1, 1.0, 30_000)
    queue("bronze", 1, 0.2, 30_000)
    assert not shed("gold") and shed("bronze")


def test_request_ids_carry_their_creation_time() -> None:
    from gateway.inference.consumers import created_of, new_request_id

    before = int(time.time())
    rid = new_request_id()
    assert before <= created_of(rid) <= int(time.time())
    assert len(rid) == 31 and rid != new_request_id()
    assert abs(created_of("not-a-time-id") - time.time()) < 2
