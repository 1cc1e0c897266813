"""A tenant sees only the models it may use, without engine details, and a model served only by
another tenant's dedicated pool is unknown to it: 404, exactly like a name that does not exist,
on the management API and on /v1."""

from __future__ import annotations

import asyncio

import pytest
from django.contrib.auth.models import Permission
from rest_framework.test import APIClient

from gateway.inference import pools
from gateway.inference.errors import ApiError
from tests import rkeys
from tests.factories import make_model, make_pool, make_tenant
from tests.worlds import build_world, make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(redis_client, settings):
    world = build_world()
    make_pool(make_model("private", tokenizer_path="/models/private/tok.json"),
              name="other-only", dedicated_to=world.other)
    make_pool(make_model("switched-off"), name="off", enabled=False)
    pools.forget_catalog()
    yield world
    pools.forget_catalog()


def _client(user) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


def test_members_list_only_their_models_without_engine_details(world):
    """Before: every model, with engine id and tokenizer path, for any member."""
    client = _client(world.users["member"])
    rows = client.get("/api/models/").json()["results"]
    assert [r["name"] for r in rows] == ["sim-small"]
    assert set(rows[0]) == {"name", "max_model_len", "created_at"}
    unknown = client.get("/api/models/no-such-model/")
    private = client.get("/api/models/private/")
    assert private.status_code == unknown.status_code == 404
    assert private.json()["error"]["code"] == unknown.json()["error"]["code"]
    outsider = _client(world.users["outsider"]).get("/api/models/").json()["results"]
    assert [r["name"] for r in outsider] == ["private", "sim-small"]


def test_staff_with_the_view_permission_see_every_model_in_full(world):
    staff = make_user("catalog", is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_servedmodel"))
    rows = _client(staff).get("/api/models/").json()["results"]
    assert {r["name"] for r in rows} == {"private", "sim-small", "switched-off"}
    assert next(r for r in rows if r["name"] == "private")["tokenizer_path"] == \
        "/models/private/tok.json"


def _choose(model: str, tenant_id: int) -> int:
    try:
        asyncio.run(pools.choose_pool(model, tenant_id, "local", frozenset()))
    except ApiError as exc:
        return exc.status
    return 200


@pytest.mark.django_db(transaction=True)
def test_v1_routing_answers_404_for_another_tenants_private_model(redis_client, settings):
    """Before: 503 ``no_pool``, which told the caller the model exists."""
    world = build_world()
    make_pool(make_model("private"), name="other-only", dedicated_to=world.other)
    rkeys.served(redis_client, "other-only", world.pool.name)
    pools.forget_catalog()
    try:
        assert _choose("private", world.tenant.pk) == _choose("no-such-model", world.tenant.pk)
        assert _choose("private", world.tenant.pk) == 404
        assert _choose("private", world.other.pk) == 200
        assert _choose("sim-small", world.tenant.pk) == 200
    finally:
        pools.forget_catalog()


@pytest.mark.django_db(transaction=True)  # the table is read in a thread, on its own connection
def test_a_model_added_a_moment_ago_is_found_without_waiting_for_the_table_ttl(redis_client):
    """An unknown name reloads a table older than MISS_RELOAD_S, not only after TTL: a pool
    just added is served at once (serve's tests met a 404 while its worker was already up)."""
    pools.forget_catalog()
    tenant_id = make_tenant().pk
    asyncio.run(pools.catalog())  # cached now, without the new model
    make_pool(make_model("fresh-model"), name="fresh-pool")
    with pytest.raises(ApiError):  # within MISS_RELOAD_S: the cached table answers
        asyncio.run(pools.candidate_pools("fresh-model", tenant_id, "local", frozenset()))
    pools._cache = (pools._cache[0] - pools.MISS_RELOAD_S - 0.01, pools._cache[1])
    found = asyncio.run(pools.candidate_pools("fresh-model", tenant_id, "local", frozenset()))
    assert [p.name for p in found] == ["fresh-pool"]
    assert pools.MISS_RELOAD_S < pools.TTL
    pools.forget_catalog()
