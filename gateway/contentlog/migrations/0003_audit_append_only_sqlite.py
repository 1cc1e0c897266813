"""On SQLite (the embedded quick start), the audit log is append-only in the database too.

PostgreSQL got its trigger in 0002; SQLite has no functions, so two triggers abort any UPDATE or
DELETE of a row. ``_forward`` is also what tests/test_breakglass_append_only.py runs on a fresh
SQLite connection.
"""

from django.db import migrations

SQLITE_CREATE = [
    """CREATE TRIGGER IF NOT EXISTS contentlog_audit_no_update
       BEFORE UPDATE ON contentlog_auditentry
       BEGIN SELECT RAISE(ABORT, 'contentlog_auditentry is append-only'); END""",
    """CREATE TRIGGER IF NOT EXISTS contentlog_audit_no_delete
       BEFORE DELETE ON contentlog_auditentry
       BEGIN SELECT RAISE(ABORT, 'contentlog_auditentry is append-only'); END""",
]
SQLITE_DROP = [
    "DROP TRIGGER IF EXISTS contentlog_audit_no_update",
    "DROP TRIGGER IF EXISTS contentlog_audit_no_delete",
]


def _forward(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        for statement in SQLITE_CREATE:
            schema_editor.execute(statement)


def _backward(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        for statement in SQLITE_DROP:
            schema_editor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [("contentlog", "0002_audit_append_only_trigger")]
    operations = [migrations.RunPython(_forward, _backward)]
