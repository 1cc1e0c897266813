"""Moving management tokens and the content-logging audit trail from the portal app to
``tenants`` keeps every row: the tables keep their names, only Django's model state moves."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from tenants.models import ContentLoggingChange, ManagementToken

BEFORE = [("tenants", "0003_identity_providers_client_certs_retention"),
          ("portal", "0001_initial")]


@pytest.mark.django_db(transaction=True)
def test_rows_made_by_the_portal_app_are_there_after_the_move() -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    try:
        old = MigrationExecutor(connection).loader.project_state(BEFORE).apps
        tenant = old.get_model("tenants", "Tier").objects.create(name="t")
        tenant = old.get_model("tenants", "Tenant").objects.create(name="A", slug="a",
                                                                   tier=tenant)
        old.get_model("portal", "ManagementToken").objects.create(
            tenant_id=tenant.pk, name="ci", role="billing", key_hash="h" * 64,
            pepper_version=1, prefix="igwmgmt_abc", last_four="wxyz")
        old.get_model("portal", "ContentLoggingChange").objects.create(
            tenant_id=tenant.pk, enabled=True)
    finally:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        # Forward to the latest state (the move, and every migration after it), so the tests
        # that run after this one find the schema the models describe.
        executor.migrate(executor.loader.graph.leaf_nodes())
    token = ManagementToken.objects.get()
    assert (token.name, token.tenant.slug, token.last_four) == ("ci", "a", "wxyz")
    assert ContentLoggingChange.objects.get().enabled is True
