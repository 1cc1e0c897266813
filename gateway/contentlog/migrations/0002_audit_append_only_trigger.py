"""On PostgreSQL, make the audit log append-only in the database too, not only in the ORM."""

from django.db import migrations

_CREATE = """
CREATE OR REPLACE FUNCTION contentlog_audit_append_only() RETURNS trigger AS $$
BEGIN
  RAISE EXCEPTION 'contentlog_auditentry is append-only';
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER contentlog_audit_append_only
  BEFORE UPDATE OR DELETE ON contentlog_auditentry
  FOR EACH ROW EXECUTE FUNCTION contentlog_audit_append_only();
"""
_DROP = """
DROP TRIGGER IF EXISTS contentlog_audit_append_only ON contentlog_auditentry;
DROP FUNCTION IF EXISTS contentlog_audit_append_only();
"""


def _forward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_CREATE)


def _backward(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_DROP)


class Migration(migrations.Migration):
    dependencies = [("contentlog", "0001_initial")]
    operations = [migrations.RunPython(_forward, _backward)]
