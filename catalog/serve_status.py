"""What ``manage.py serve`` reports about each pool's worker process, for the pool's admin page.

One Redis hash per pool, ``serve:pool:{name}``: the worker's state (starting, running,
restarting, failing), its pid, how its last run ended (``exit status 1``, ``killed by
SIGKILL``), the last lines it printed and when this was written. serve writes it on every start,
readiness and exit of the pool's worker, and deletes it when it stops the worker. A pool no serve
runs has no record. Reporting never raises: a Redis that is down must not stop the supervisor.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from infra.redis_conn import get_redis, key

log = logging.getLogger(__name__)

# Kept after a serve that was killed outright (it cannot delete it), then it goes stale.
RECORD_TTL_S = 7 * 24 * 3600


def status_key(pool: str) -> str:
    return key("serve", "pool", pool)


def report(pool: str, *, state: str, pid: int | None, last_exit: str = "", output: str = "",
           restarts: int = 0) -> None:
    fields: dict[Any, Any] = {"state": state, "pid": pid or "", "last_exit": last_exit,
                              "output": output, "restarts": restarts, "at": f"{time.time():.3f}"}
    try:
        pipe = get_redis().pipeline()
        pipe.hset(status_key(pool), mapping=fields)
        pipe.expire(status_key(pool), RECORD_TTL_S)
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("could not record pool %s's worker state (%s): %s", pool, state, exc)


def clear(pool: str) -> None:
    try:
        get_redis().delete(status_key(pool))
    except redis.RedisError as exc:
        log.warning("could not clear pool %s's worker state: %s", pool, exc)


def read(pool: str) -> dict[str, str] | None:
    """The record, or None when no serve runs this pool's worker (or Redis cannot say)."""
    try:
        raw = get_redis().hgetall(status_key(pool))
    except redis.RedisError:
        return None
    return {_text(k): _text(v) for k, v in raw.items()} or None


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
