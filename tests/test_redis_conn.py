"""infra.redis_conn: what each new connection costs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.utils

from infra import redis_conn


def test_new_connections_reuse_one_driver_info_and_still_name_the_library(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst opens many pooled connections on the request path; none may read the package
    metadata again (2.7 ms of CPU each), and what CLIENT SETINFO sends (Redis >= 7.2) still
    names redis-py's version."""
    version = redis_conn.driver_info().lib_version
    lookups: list[str] = []
    real = redis.utils.metadata.version
    monkeypatch.setattr(redis.utils.metadata, "version",
                        lambda name: lookups.append(name) or real(name))

    async def burst() -> list[Any]:
        pool = redis_conn.new_async_pool()
        client = aioredis.Redis(connection_pool=pool)
        conns = [await pool.get_connection() for _ in range(5)]  # type: ignore[no-untyped-call]
        for conn in conns:
            await pool.release(conn)
        assert await client.ping()
        await pool.disconnect()
        return conns

    conns = asyncio.run(burst())
    assert len({id(c) for c in conns}) == 5
    assert lookups == []
    assert all(c.driver_info is redis_conn.driver_info() for c in conns)
    assert version == real("redis") and redis_conn.driver_info().name == "redis-py"
    assert redis_conn.get_redis().connection_pool.connection_kwargs["driver_info"] \
        is redis_conn.driver_info()


async def _checkout_after_server_close(pool: aioredis.ConnectionPool) -> Any:
    """PING on a raw connection from ``pool`` after the server closed the pooled one.

    Raw, as the worker's step batch sends: no retry policy can hide a stale connection."""
    conn = await pool.get_connection()  # type: ignore[no-untyped-call]
    await conn.send_command("CLIENT", "ID")
    cid = await conn.read_response()
    await pool.release(conn)
    redis_conn.new_redis().client_kill_filter(_id=cid)
    await asyncio.sleep(0.2)  # the close has reached this process
    conn = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        await conn.send_command("PING")
        return await conn.read_response()
    finally:
        await pool.release(conn)
        await pool.disconnect()


@pytest.mark.parametrize("make_pool", [
    lambda: redis_conn.new_async_redis().connection_pool, redis_conn.new_async_pool])
def test_a_pooled_connection_the_server_closed_is_replaced_at_checkout(make_pool) -> None:
    """After a Redis restart every pooled connection is dead. redis-py 8 skips its check for
    that when maintenance notifications are on (its default with RESP3): the step batch then
    failed on its first write after the restart and ended streams with stream_broken."""
    assert asyncio.run(_checkout_after_server_close(make_pool())) in (b"PONG", "PONG", True)

