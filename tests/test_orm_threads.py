"""ORM calls made from the event loop recover from a database outage.

The pool table is read in a worker thread (``gateway.orm.in_thread``). When the database drops
its connections, the next read in that thread fails and routing keeps the cached table; once
the database answers again, the read after must reconnect, so a pool added in the admin during
or after the outage becomes routable. Before, the thread kept its broken connection and every
later read failed, so the new pool never appeared until the process restarted.
"""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from gateway.inference import pools
from gateway.inference.errors import ApiError
from tests import rkeys
from tests.factories import make_model, make_pool, make_tenant
from tests.procs import arun

pytestmark = pytest.mark.django_db(transaction=True)


def _backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def _drop_connections(*keep: int) -> int:
    """What a database restart does to its clients: every other session is cut."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND NOT pid = ANY(%s)", [list(keep)])
        return cursor.fetchone()[0]


def _close() -> None:
    connection.close()  # this thread's connection (the proxy resolves where it runs)


@pytest.fixture
def fresh_catalog(monkeypatch):
    monkeypatch.setattr(pools, "TTL", 0.0)  # read the table on every call
    pools.forget_catalog()
    yield
    pools.forget_catalog()


def test_a_pool_added_after_a_database_outage_becomes_routable(fresh_catalog, redis_client):
    tenant = make_tenant()
    rkeys.served(redis_client, "late")  # a worker serves it once the table has it
    make_pool(make_model("before-model"), name="before")
    late_model = make_model("late-model")
    main = _backend_pid()  # the test's own connection stays up (pytest-django tears down on it)

    async def scenario() -> list[str]:
        assert [p.name for p in (await pools.catalog()).pools] == ["before"]
        assert await sync_to_async(_drop_connections)(main) >= 1  # the outage
        await pools.catalog()  # fails in its thread; the cached table keeps routing
        await sync_to_async(make_pool)(late_model, name="late")  # the admin adds a pool
        seen = []
        for _ in range(3):  # any of these may land on the thread that saw the outage
            try:
                chosen = await pools.choose_pool("late-model", tenant.id, tenant.region,
                                                 frozenset())
                seen.append(chosen.name)
            except ApiError as exc:
                seen.append(exc.code or "error")
        await sync_to_async(_drop_connections)(main)  # leave no session behind: the pool
        await sync_to_async(_close)()  # threads', then the sync thread's own
        return seen

    assert arun(scenario()) == ["late", "late", "late"]
