"""The Redis Lua scripts, each loaded once per process and run by SHA.

Every change to shared hot state (buckets, counters, request state, worker liveness) happens in
one of these scripts, so it is atomic across any number of gateway and worker processes.

A line ``--! include NAME`` is replaced, when the script is loaded, by ``prelude/NAME.lua`` (or
``NAME.lua`` when NAME has a folder, as ``wfq/common``): what
several scripts share (the clock, the token-bucket refill, the WFQ helpers) is written once, and
each script still reaches Redis as one self-contained body (its SHA is that of the whole).
"""

from __future__ import annotations

import hashlib
import re
from functools import cache
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

_DIR = Path(__file__).resolve().parent
_INCLUDE = re.compile(r"^--! include ([a-z_/]+)$", re.MULTILINE)


def _prelude(name: str) -> Path:
    return _DIR / f"{name}.lua" if "/" in name else _DIR / "prelude" / f"{name}.lua"


def source(*relative: str) -> str:
    """The files' bodies, concatenated, with their preludes expanded (each at most once)."""
    seen: set[str] = set()

    def expand(text: str) -> str:
        def one(match: re.Match[str]) -> str:
            name = match.group(1)
            if name in seen:
                return f"-- (prelude {name} already included)"
            seen.add(name)
            return expand(_prelude(name).read_text()).rstrip("\n")
        return _INCLUDE.sub(one, text)

    return "\n".join(expand((_DIR / r).read_text()) for r in relative)


class LuaScript:
    """A script run by EVALSHA, falling back to EVAL when the server has not seen it yet."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = source(f"{name}.lua")
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
