"""The Redis Lua scripts, each loaded once per process and run by SHA.

Every change to shared hot state (buckets, counters, request state, worker liveness) happens in
one of these scripts, so it is atomic across any number of gateway and worker processes.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

_DIR = Path(__file__).resolve().parent


class LuaScript:
    """A script run by EVALSHA, falling back to EVAL when the server has not seen it yet."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = (_DIR / f"{name}.lua").read_text()
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def run(self, client: redis.Redis, keys: list[str], args: list[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return client.eval(self.source, len(keys), *keys, *args)

    async def run_async(self, client: aioredis.Redis, keys: list[str], args: list[Any]) -> Any:
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.eval(self.source, len(keys), *keys, *args)

    def queue(self, pipe: Any, keys: list[str], args: list[Any]) -> None:
        """Add to a pipeline. EVAL with the body: a pipeline cannot recover from NOSCRIPT."""
        pipe.eval(self.source, len(keys), *keys, *args)


@cache
def script(name: str) -> LuaScript:
    return LuaScript(name)
