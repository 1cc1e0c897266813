"""The break-glass audit log is append-only in the database itself, on every supported database:
PostgreSQL (the suite's database, trigger from migration 0002) and SQLite (the embedded quick
start, triggers from migration 0003, applied here to a fresh SQLite file)."""

from __future__ import annotations

import importlib
import uuid

import pytest
from django.db import connection, transaction
from django.db.backends.sqlite3.base import DatabaseWrapper

from gateway.contentlog.models import AuditEntry

SQLITE_MIGRATION = importlib.import_module(
    "gateway.contentlog.migrations.0003_audit_append_only_sqlite")
INSERT = ("INSERT INTO contentlog_auditentry (tenant_id, action, actor_username, request_id, "
          "justification, created_at) VALUES (1, 'requested', 'alice', '', 'why', "
          "'2026-12-01 00:00:00')")


@pytest.fixture
def sqlite(tmp_path, django_db_blocker):
    django_db_blocker.unblock()  # a private SQLite file, not the suite's database
    db = DatabaseWrapper({
        "ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "audit.sqlite3"),
        "OPTIONS": {}, "TIME_ZONE": None, "CONN_MAX_AGE": 0, "CONN_HEALTH_CHECKS": False,
        "AUTOCOMMIT": True, "ATOMIC_REQUESTS": False, "USER": "", "PASSWORD": "", "HOST": "",
        "PORT": "", "TEST": {},
    }, alias="audit-sqlite")
    with db.schema_editor(atomic=False) as editor:
        editor.create_model(AuditEntry)
        SQLITE_MIGRATION._forward(None, editor)
    yield db
    db.close()
    django_db_blocker.restore()


def test_sqlite_refuses_update_and_delete(sqlite):
    with sqlite.cursor() as cur:
        cur.execute(INSERT)
        cur.execute(INSERT)  # appending is what the log is for
        for statement in ("UPDATE contentlog_auditentry SET justification = 'rewritten'",
                          "DELETE FROM contentlog_auditentry",
                          "DELETE FROM contentlog_auditentry WHERE id = 1"):
            with pytest.raises(Exception, match="append-only"):
                cur.execute(statement)
        cur.execute("SELECT count(*), min(justification) FROM contentlog_auditentry")
        assert cur.fetchone() == (2, "why")


def test_sqlite_triggers_can_be_dropped_by_the_reverse_migration(sqlite):
    with sqlite.schema_editor(atomic=False) as editor:
        SQLITE_MIGRATION._backward(None, editor)
    with sqlite.cursor() as cur:
        cur.execute(INSERT)
        cur.execute("DELETE FROM contentlog_auditentry")


@pytest.mark.django_db
@pytest.mark.parametrize("statement", [
    "UPDATE contentlog_auditentry SET justification = 'rewritten'",
    "DELETE FROM contentlog_auditentry",
])
def test_postgresql_refuses_update_and_delete(statement):
    if connection.vendor != "postgresql":
        pytest.skip("the suite's database is not PostgreSQL")
    AuditEntry.objects.create(tenant_id=1, action="requested", actor_username="alice",
                              record_id=uuid.uuid4(), justification="why")
    with pytest.raises(Exception, match="append-only"), transaction.atomic(), \
            connection.cursor() as cur:
        cur.execute(statement)
    assert AuditEntry.objects.get().justification == "why"


@pytest.mark.django_db
def test_postgresql_refuses_truncate_of_a_non_empty_log():
    """Review 3, N10: the row triggers do not fire on TRUNCATE, which emptied the log."""
    if connection.vendor != "postgresql":
        pytest.skip("the suite's database is not PostgreSQL")
    AuditEntry.objects.create(tenant_id=1, action="requested", actor_username="alice",
                              record_id=uuid.uuid4(), justification="why")
    for statement in ("TRUNCATE contentlog_auditentry",
                      "TRUNCATE contentlog_auditentry RESTART IDENTITY CASCADE"):
        with pytest.raises(Exception, match="append-only"), transaction.atomic(), \
                connection.cursor() as cur:
            cur.execute("SET LOCAL igw.audit_truncate = ''")  # what the application has
            cur.execute(statement)
    assert AuditEntry.objects.count() == 1
