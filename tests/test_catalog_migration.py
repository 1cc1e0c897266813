"""The catalog's move out of ``tenants`` changes Django's state, not the tables (ADR 0030).

A database at main's state (tenants' last migration, no catalog app) holds a model, a pool
dedicated to a tenant, a route, a quota and a key limited to the model; migrating forward keeps
every row and relation, reads them through the catalog's models, and moves the content types
(so ``change_pool`` permissions follow). Migrating back gives the tenants app its models again.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

BEFORE = [("tenants", "0011_apikey_rotated_at"), ("catalog", None)]
AFTER = [("tenants", "0012_catalog_moves_out"), ("catalog", "0001_initial")]

# Slow: rendering every app's migration state three times takes 10-25 s on the CI machine.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _migrate(targets: list[tuple[str, str | None]]) -> Any:
    """Migrate to ``targets``; the models as the database now has them (every applied node)."""
    MigrationExecutor(connection).migrate(targets)
    return MigrationExecutor(connection)._create_project_state(with_applied_migrations=True).apps


def _rows_at_main(apps: Any) -> dict[str, int]:
    tier = apps.get_model("tenants", "Tier").objects.create(name="mig-tier")
    tenant = apps.get_model("tenants", "Tenant").objects.create(
        name="Mig", slug="mig", tier=tier)
    model = apps.get_model("tenants", "ServedModel").objects.create(
        name="mig-model", engine_model_id="mig-model")
    pool = apps.get_model("tenants", "Pool").objects.create(
        name="mig-pool", model=model, dedicated_to=tenant)
    route = apps.get_model("tenants", "Route").objects.create(name="mig-route")
    apps.get_model("tenants", "RouteTarget").objects.create(route=route, pool=pool, weight=2.0)
    apps.get_model("tenants", "Quota").objects.create(tenant=tenant, model=model)
    key = apps.get_model("tenants", "ApiKey").objects.create(
        tenant=tenant, name="k", key_hash="h" * 64, pepper_version=1, prefix="p", last_four="abcd")
    key.allowed_models.add(model)
    content_type = apps.get_model("contenttypes", "ContentType")
    content_type.objects.get_or_create(app_label="tenants", model="pool")
    return {"tenant": tenant.pk, "model": model.pk, "pool": pool.pk, "key": key.pk}


def test_an_existing_database_keeps_its_rows_across_the_move() -> None:
    try:
        ids = _rows_at_main(_migrate(BEFORE))
        apps = _migrate(AFTER)

        pool = apps.get_model("catalog", "Pool").objects.get(pk=ids["pool"])
        assert (pool.name, pool.model_id, pool.dedicated_to_id) == (
            "mig-pool", ids["model"], ids["tenant"])
        target = apps.get_model("catalog", "RouteTarget").objects.get(pool=pool)
        assert (target.route.name, target.weight) == ("mig-route", 2.0)
        quota = apps.get_model("tenants", "Quota").objects.get(tenant_id=ids["tenant"])
        assert quota.model.name == "mig-model"  # a tenants row follows its FK into the catalog
        key = apps.get_model("tenants", "ApiKey").objects.get(pk=ids["key"])
        assert [m.name for m in key.allowed_models.all()] == ["mig-model"]
        content_type = apps.get_model("contenttypes", "ContentType")
        assert content_type.objects.filter(app_label="catalog", model="pool").exists()
        assert not content_type.objects.filter(app_label="tenants", model="pool").exists()

        back = _migrate(BEFORE)  # reversible: the tenants app has its models again
        assert back.get_model("tenants", "Pool").objects.get(pk=ids["pool"]).name == "mig-pool"
        assert content_type.objects.filter(app_label="tenants", model="pool").exists()
    finally:
        _migrate(AFTER)
