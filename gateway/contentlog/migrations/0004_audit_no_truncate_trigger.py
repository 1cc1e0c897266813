"""On PostgreSQL, TRUNCATE of the audit log is refused too (review 3, N10).

Row triggers (0002) do not fire on TRUNCATE, so ``TRUNCATE contentlog_auditentry`` emptied the
append-only log. A statement trigger refuses it unless the table is already empty (nothing to
lose: a fresh database's ``manage.py flush``) or the session has set
``igw.audit_truncate = 'allow'``, which only the test harness does (tests/conftest.py), to empty
its database between transactional tests.
"""

from django.db import migrations

_CREATE = """
CREATE OR REPLACE FUNCTION contentlog_audit_no_truncate() RETURNS trigger AS $$
BEGIN
  IF coalesce(current_setting('igw.audit_truncate', true), '') = 'allow' THEN
    RETURN NULL;
  END IF;
  IF EXISTS (SELECT 1 FROM contentlog_auditentry) THEN
    RAISE EXCEPTION 'contentlog_auditentry is append-only (TRUNCATE refused)';
  END IF;
  RETURN NULL;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER contentlog_audit_no_truncate
  BEFORE TRUNCATE ON contentlog_auditentry
  FOR EACH STATEMENT EXECUTE FUNCTION contentlog_audit_no_truncate();
"""
_DROP = """
DROP TRIGGER IF EXISTS contentlog_audit_no_truncate ON contentlog_auditentry;
DROP FUNCTION IF EXISTS contentlog_audit_no_truncate();
"""


def _forward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_CREATE)


def _backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_DROP)


class Migration(migrations.Migration):
    dependencies = [("contentlog", "0003_audit_append_only_sqlite")]
    operations = [migrations.RunPython(_forward, _backward)]
