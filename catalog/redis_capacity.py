"""How many Redis shards and cells a demand needs, from Redis's measured cost per token.

Redis runs its commands on one thread, so a shard's capacity is CPU on one core. The cost of
serving is linear in what flows through it: each request pays a fixed part (admit, enqueue,
dispatch, claim, settle, usage record) and each streamed token a variable part (its share of
the step batch's XADD and the relay's XREAD). ``bench/redis_cost.py`` measures both on a real
gateway and worker; this module only does the arithmetic.

A cell is the gateways, Redis and workers for a set of pools in one region (docs/adr/0019).
Without Redis Cluster a cell has exactly one Redis primary; with it, up to ``shards_per_cell``.
The cells needed are the largest of: the shards over the shards a cell may run (Redis CPU), the
replicas over the replicas a cell may hold (blast radius, one region's GPUs), and the regions
served (a cell never spans regions).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


class RedisPlanError(ValueError):
    pass


@dataclass(frozen=True)
class RedisCost:
    """Measured Redis work: per request (fixed) and per streamed output token (variable)."""

    cpu_s_per_request: float
    cpu_s_per_token: float
    commands_per_request: float
    commands_per_token: float

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value >= 0:  # also rejects NaN
                raise RedisPlanError(f"{name} must be >= 0, got {value}")
        if self.cpu_s_per_request == 0 and self.cpu_s_per_token == 0:
            raise RedisPlanError("the cost has no CPU at all: measure it first")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RedisCost:
        try:
            return cls(**{f: float(data[f]) for f in cls.__dataclass_fields__})
        except KeyError as exc:
            raise RedisPlanError(f"the cost is missing {exc.args[0]}") from None


def solve_cost(short: dict[str, float], long: dict[str, float]) -> RedisCost:
    """Per-request and per-token parts from two runs that differ only in tokens per request.

    Each run gives ``{"requests", "tokens", "cpu_s", "commands"}``; with
    ``total = per_request x requests + per_token x tokens`` for both runs, two equations give the
    two unknowns. Measurement noise can make a part come out slightly negative: it is clamped to
    zero (the other part then carries all of it).
    """
    det = short["requests"] * long["tokens"] - long["requests"] * short["tokens"]
    if det == 0:
        raise RedisPlanError("the two runs must differ in tokens per request")

    def parts(field: str) -> tuple[float, float]:
        per_req = (short[field] * long["tokens"] - long[field] * short["tokens"]) / det
        per_tok = (short["requests"] * long[field] - long["requests"] * short[field]) / det
        return max(per_req, 0.0), max(per_tok, 0.0)

    cpu_req, cpu_tok = parts("cpu_s")
    cmd_req, cmd_tok = parts("commands")
    return RedisCost(cpu_req, cpu_tok, cmd_req, cmd_tok)


@dataclass(frozen=True)
class RedisPlan:
    output_tpm: float
    tokens_per_s: float
    requests_per_s: float
    commands_per_s: float
    redis_cores: float
    shard_cpu: float
    shards: int
    tokens_per_s_per_shard: float
    replicas: int
    max_replicas_per_cell: int
    cells: int
    shards_per_cell: int = 1
    regions: int = 1
    cells_for_redis: int = 1
    cells_for_replicas: int = 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_redis(cost: RedisCost, *, output_tpm: float, tokens_per_request: float,
               shard_cpu: float = 0.5, replica_tokens_per_s: float = 3040.0,
               max_replicas_per_cell: int = 50, shards_per_cell: int = 1,
               regions: int = 1) -> RedisPlan:
    """Shards and cells for ``output_tpm`` output tokens a minute.

    ``shard_cpu``: the fraction of its one core a shard may use at the planned peak (0.5 leaves
    room for bursts, background saving and replication). ``replica_tokens_per_s``: one engine
    replica's output rate (``plan_capacity`` gives it; 3,040 is the design's 8B model on 80 GB).
    """
    if not output_tpm > 0 or not tokens_per_request >= 1:
        raise RedisPlanError("demand must be > 0 tokens/min and >= 1 token per request")
    if not 0 < shard_cpu <= 1:
        raise RedisPlanError("shard_cpu is a fraction of one core: 0 < shard_cpu <= 1")
    if not replica_tokens_per_s > 0 or max_replicas_per_cell < 1:
        raise RedisPlanError("replica_tokens_per_s must be > 0, max_replicas_per_cell >= 1")
    if shards_per_cell < 1 or regions < 1:
        raise RedisPlanError("shards_per_cell and regions must be >= 1")
    tps = output_tpm / 60.0
    rps = tps / tokens_per_request
    cores = tps * cost.cpu_s_per_token + rps * cost.cpu_s_per_request
    per_token_cpu = cost.cpu_s_per_token + cost.cpu_s_per_request / tokens_per_request
    shards = max(1, math.ceil(cores / shard_cpu - 1e-9))
    replicas = math.ceil(tps / replica_tokens_per_s - 1e-9)
    for_redis = math.ceil(shards / shards_per_cell)
    for_replicas = math.ceil(replicas / max_replicas_per_cell - 1e-9)
    return RedisPlan(
        output_tpm=output_tpm, tokens_per_s=tps, requests_per_s=rps,
        commands_per_s=tps * cost.commands_per_token + rps * cost.commands_per_request,
        redis_cores=cores, shard_cpu=shard_cpu, shards=shards,
        tokens_per_s_per_shard=shard_cpu / per_token_cpu,
        replicas=replicas, max_replicas_per_cell=max_replicas_per_cell,
        cells=max(for_redis, for_replicas, regions), shards_per_cell=shards_per_cell,
        regions=regions, cells_for_redis=for_redis, cells_for_replicas=for_replicas)


def render_redis_text(cost: RedisCost, plans: list[RedisPlan]) -> str:
    lines = [
        f"Redis per request: {cost.cpu_s_per_request * 1e6:,.1f} us CPU, "
        f"{cost.commands_per_request:,.1f} commands",
        f"Redis per streamed token: {cost.cpu_s_per_token * 1e6:,.2f} us CPU, "
        f"{cost.commands_per_token:,.3f} commands",
    ]
    for p in plans:
        lines += [
            f"demand {p.output_tpm:,.0f} output tokens/min = {p.tokens_per_s:,.0f} tokens/s, "
            f"{p.requests_per_s:,.0f} requests/s",
            f"  Redis: {p.redis_cores:,.2f} cores, {p.commands_per_s:,.0f} commands/s; "
            f"one shard at {p.shard_cpu:.0%} of a core carries {p.tokens_per_s_per_shard:,.0f} "
            f"tokens/s -> {p.shards} shard(s)",
            f"  engines: {p.replicas} replicas, at most {p.max_replicas_per_cell} per cell -> "
            f"{p.cells_for_replicas} cell(s)",
            f"  cells: {p.cells} = max({p.shards} shard(s) / {p.shards_per_cell} per cell "
            f"{'(no Redis Cluster)' if p.shards_per_cell == 1 else '(Redis Cluster)'} -> "
            f"{p.cells_for_redis}, replicas -> {p.cells_for_replicas}, {p.regions} region(s))",
        ]
    return "\n".join(lines)
