"""The test harness's flush between transactional tests (tests/fast_flush.py) leaves what
Django's own flush leaves: every table empty but the rows post_migrate owns."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.db import connection

from gateway.contentlog.models import AuditEntry
from tests import fast_flush
from tests.factories import make_key, make_pool, make_tenant


@pytest.mark.django_db(transaction=True)
def test_flush_empties_every_table_but_post_migrates_rows() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the fast flush is PostgreSQL's")
    tenant = make_tenant()
    make_key(tenant)  # rows that reference others: emptied together in any order
    make_pool()
    AuditEntry.objects.create(tenant_id=tenant.pk, action=AuditEntry.Action.REQUESTED,
                              actor_username="x", justification="append-only: TRUNCATEd")
    types, permissions = ContentType.objects.count(), Permission.objects.count()
    tables = connection.introspection.django_table_names(only_existing=True,
                                                         include_views=False)
    assert {"tenants_tenant", "tenants_apikey", "contentlog_auditentry"} <= set(
        fast_flush.tables_with_rows(connection, tables))

    call_command("flush", verbosity=0, interactive=False, reset_sequences=False)

    assert set(fast_flush.tables_with_rows(connection, tables)) <= fast_flush.KEEP
    assert (ContentType.objects.count(), Permission.objects.count()) == (types, permissions)
    assert types and permissions
