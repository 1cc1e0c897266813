"""LoRA adapters are tenant data: routing and /v1/models show a tenant only its own adapters."""

from __future__ import annotations

import asyncio

import pytest

from gateway.inference import pools
from gateway.inference.errors import ApiError
from tests import rkeys
from tests.factories import make_model, make_pool, make_tenant

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def world(redis_client):
    owner, other = make_tenant("adapter-owner"), make_tenant("adapter-other")
    base = make_model("base-8b")
    pool = make_pool(base, name="lora-pool", backend="openai_upstream", backend_settings={
        "base_url": "http://127.0.0.1:9/v1",
        "lora": {"enabled": True, "adapters": [
            {"name": "support-bot", "tenant_id": owner.pk, "path": "/adapters/support-bot"},
        ]},
    })
    rkeys.served(redis_client, pool.name)
    pools.forget_catalog()
    yield owner, other, pool
    pools.forget_catalog()


def run(coro):
    return asyncio.run(coro)


def test_the_owner_is_routed_to_its_adapter_on_the_base_models_pool(world):
    owner, _, pool = world
    chosen = run(pools.choose_pool("support-bot", owner.pk, owner.region, frozenset()))
    assert chosen.name == pool.name
    assert chosen.adapter == "support-bot"
    assert chosen.model.name == "base-8b"  # tokenized with the base model's tokenizer


def test_another_tenant_naming_the_adapter_gets_model_not_found(world):
    _, other, _ = world
    with pytest.raises(ApiError) as caught:
        run(pools.choose_pool("support-bot", other.pk, other.region, frozenset()))
    with pytest.raises(ApiError) as never_existed:
        run(pools.choose_pool("no-such-model", other.pk, other.region, frozenset()))
    # Exactly the answer for a model that does not exist, so existence does not leak.
    assert caught.value.status == never_existed.value.status == 404
    assert caught.value.code == never_existed.value.code


def test_adapters_appear_in_the_model_list_of_their_owner_only(world):
    owner, other, _ = world
    mine = [m.name for m in run(pools.visible_models(owner.pk, owner.region, frozenset()))]
    theirs = [m.name for m in run(pools.visible_models(other.pk, other.region, frozenset()))]
    assert "support-bot" in mine and "base-8b" in mine
    assert "support-bot" not in theirs and "base-8b" in theirs


def test_a_key_limited_to_another_base_model_cannot_reach_the_adapter(world):
    owner, _, _ = world
    make_model("other-model")
    with pytest.raises(ApiError):
        run(pools.choose_pool("support-bot", owner.pk, owner.region, frozenset({"other-model"})))
    allowed = run(pools.choose_pool("support-bot", owner.pk, owner.region,
                                    frozenset({"base-8b"})))
    assert allowed.adapter == "support-bot"
