"""A faster empty-the-database between transactional tests, on PostgreSQL.

Django's ``flush`` (what ``TransactionTestCase`` runs after each test) TRUNCATEs every table and
then re-runs ``post_migrate`` (content types, permissions). On the 2-core CI machine that cost
1-3 s per transactional test, most of the live lane's teardown: a TRUNCATE of 44 tables makes
new files for each table and index, and waits for an exclusive lock that a live gateway's or
worker's open transaction holds up.

Here the tables that hold rows are found in one query and emptied with DELETE in one
transaction (Django's foreign keys on PostgreSQL are DEFERRABLE INITIALLY DEFERRED, so the order
does not matter); the append-only audit log refuses DELETE and is TRUNCATEd as before (the
harness allows it, tests/conftest.py). Content types and permissions are left as they are:
``post_migrate`` would only write the same rows back, so it is not run. The end state is the
one Django's flush leaves; sequences are not reset by either (``reset_sequences`` is off; a test
that asks for it gets Django's own flush).
"""

from __future__ import annotations

from typing import Any

# Rows that post_migrate owns: kept, so post_migrate need not run again.
KEEP = frozenset({"django_content_type", "auth_permission", "django_migrations"})
# Refuses DELETE (a row trigger); TRUNCATE is allowed to the harness only.
TRUNCATED = frozenset({"contentlog_auditentry"})


def tables_with_rows(connection: Any, tables: list[str]) -> list[str]:
    if not tables:
        return []
    qn = connection.ops.quote_name
    query = " UNION ALL ".join(f"SELECT %s WHERE EXISTS (SELECT 1 FROM {qn(t)})" for t in tables)
    with connection.cursor() as cur:
        cur.execute(query, tables)
        return [row[0] for row in cur.fetchall()]


def empty_tables(connection: Any) -> None:
    from django.db import transaction

    qn = connection.ops.quote_name
    tables = connection.introspection.django_table_names(only_existing=True, include_views=False)
    full = tables_with_rows(connection, [t for t in tables if t not in KEEP])
    with transaction.atomic(using=connection.alias), connection.cursor() as cur:
        for table in full:
            verb = "TRUNCATE" if table in TRUNCATED else "DELETE FROM"
            cur.execute(f"{verb} {qn(table)}")


def install() -> Any:
    """Make ``manage.py flush`` (as the test cases call it) take the fast path; returns the
    function that undoes it."""
    from django.core.management.commands import flush
    from django.db import connections

    real = flush.Command.handle

    def handle(self: Any, **options: Any) -> Any:
        connection = connections[options["database"]]
        if (connection.vendor != "postgresql" or options.get("reset_sequences", True)
                or options.get("interactive", True)):
            return real(self, **options)
        empty_tables(connection)
        return None

    flush.Command.handle = handle  # type: ignore[method-assign]

    def undo() -> None:
        flush.Command.handle = real  # type: ignore[method-assign]

    return undo
