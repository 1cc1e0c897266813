"""Split a tenant's token quota across the cells that serve it, and move it by demand.

A cell (docs/adr/0019) is the gateways, Redis and workers for a set of pools in one region. A
tenant served in n cells has its tenant token buckets in n Redis servers; each holds the cell's
*share* of the quota (``share_rate``, ``share_burst`` in the bucket hash, read by admit.lua and
settle.lua, invariant C1), so every cell enforces its share atomically with each charge.

The bound. Write R, B for the quota's rate and burst and r_c(t), b_c(t) for cell c's share.
The rebalancer keeps, at every instant,

    sum_c r_c(t) <= R   and   sum_c b_c(t) <= B                                      (S)

because a step only shrinks a figure, or grows it by at most the headroom left after every
other cell's share is counted at an upper bound of its true value (cell_share.lua C2, C4, and
``rebalance`` below: shrink every cell first, then grow from what the shrinks freed; a cell
that cannot be reached or answered ambiguously is counted at the larger of the values it may
hold). Each cell's bucket refills at its current rate and is capped at its current burst
(C3, and settle.lua reads the same share), so the tokens cell c admits in a window [t0, t1] are
at most b_c(t0) + integral of r_c. Summing with (S): the tokens admitted by all cells together in
any window of T seconds are at most

    B + R * T / 60          (tokens; R per minute)

which is the bound of the undivided quota in one Redis: splitting adds no overshoot. As for one
bucket, tokens refunded at settlement (charged as max_tokens, unused) are admitted again.
Two caveats, written in the ADR: a shrink lost in a Redis failover (asynchronous replication)
could bring back a larger share, unless ``wait_replicas`` makes the shrink wait for a replica;
and while a tenant's cells are being changed, a gateway whose cached principal predates the
change may charge the undivided quota for up to AUTH_CACHE_SECONDS.

Demand is the tokens requested (prompt + max_tokens, admitted or refused) counted in the output
bucket hash's ``demand`` field by the gateway, read and reset by each rebalance.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis

from serving.admission import AdmissionLimits, bucket_key
from serving.lua import script
from serving.wire import text

FIGURES = ("in_rate", "in_burst", "out_rate", "out_burst")


@dataclass(frozen=True)
class Share:
    """Token rates (per minute) and bursts of one cell's share, or of the whole quota."""

    in_rate: float
    in_burst: float
    out_rate: float
    out_burst: float

    def figures(self) -> tuple[float, float, float, float]:
        return (self.in_rate, self.in_burst, self.out_rate, self.out_burst)

    @classmethod
    def of(cls, values: Iterable[Any]) -> Share:
        return cls(*(float(v) for v in values))

    def scaled(self, fraction: float) -> Share:
        """This share times ``fraction``, rounded down so that parts never sum above it.

        Rounded to 6 decimals first, so that 10,000 x 0.1 is 1,000, not 999 (float noise):
        for integer figures the parts still sum to at most the whole, as a sum of integers
        within n x 5e-7 above it is not above it.
        """
        return Share.of(math.floor(round(f * fraction, 6)) for f in self.figures())

    def minus(self, other: Share) -> Share:
        return Share.of(a - b for a, b in zip(self.figures(), other.figures(), strict=True))

    def plus(self, other: Share) -> Share:
        return Share.of(a + b for a, b in zip(self.figures(), other.figures(), strict=True))

    def lower(self, other: Share) -> Share:
        return Share.of(min(a, b) for a, b in zip(self.figures(), other.figures(), strict=True))

    def at_least_zero(self) -> Share:
        return Share.of(max(0.0, f) for f in self.figures())


ZERO = Share(0, 0, 0, 0)


def total(shares: Mapping[str, Share] | list[Share]) -> Share:
    out = ZERO
    for share in (shares.values() if isinstance(shares, Mapping) else shares):
        out = out.plus(share)
    return out


def quota_of(limits: object) -> Share:
    """The tenant quota as a Share, from ``tenants.limits.Limits`` (or anything alike)."""
    return Share.of(getattr(limits, f) for f in
                    ("input_tpm", "input_burst", "output_tpm", "output_burst"))


def floor_share(quota: Share, n_cells: int, floor: float) -> Share:
    """What each cell keeps at least, and what a cell without a recorded share enforces.

    At least 1 of each figure: a rate of 0 would mean "not limited" to admit.lua.
    """
    return Share.of(max(1.0, f) for f in quota.scaled(floor / n_cells).figures())


def plan(quota: Share, demand: Mapping[str, float], n_floor: float) -> dict[str, Share] | None:
    """Target shares: the floor each, the rest in proportion to demand; None = no demand seen.

    ``n_floor`` is the floor fraction (``CELL_SHARE_FLOOR``) of the quota spread over the cells.
    Every target is at least the floor share and the targets sum to at most the quota.
    """
    busy = sum(max(0.0, d) for d in demand.values())
    if busy <= 0:
        return None
    n = len(demand)
    base = floor_share(quota, n, n_floor)
    spare = quota.minus(_times(base, n)).at_least_zero()
    return {c: base.plus(spare.scaled(max(0.0, d) / busy)) for c, d in demand.items()}


def _times(share: Share, n: int) -> Share:
    return Share.of(f * n for f in share.figures())


# -- one cell's step (cell_share.lua) ---------------------------------------------------------


@dataclass(frozen=True)
class CellStep:
    before: Share
    after: Share
    demand: float


def _share_keys(tenant_id: object) -> list[str]:
    return [bucket_key(tenant_id, "tenant", None, kind) for kind in ("in", "out")]


def _step(client: redis.Redis, tenant_id: object, mode: str, floor: Share,
          target: Share = ZERO, allowance: Share = ZERO) -> CellStep:
    # ARGV[1] '': the script reads the clock from Redis (TIME), one clock for every process.
    args = ["", mode, *floor.figures(), *target.figures(), *allowance.figures()]
    raw = [text(v) for v in script("cell_share").run(client, _share_keys(tenant_id), args)]
    return CellStep(Share.of(raw[0:4]), Share.of(raw[4:8]), float(raw[8]))


def read_cell(client: redis.Redis, tenant_id: object, floor: Share) -> CellStep:
    """The share in force and the demand since the last read (which this resets)."""
    return _step(client, tenant_id, "read", floor)


def peek_cell(client: redis.Redis, tenant_id: object, floor: Share) -> CellStep:
    """The share in force and the demand counted so far, changing nothing."""
    return _step(client, tenant_id, "peek", floor)


def set_cell(client: redis.Redis, tenant_id: object, floor: Share, target: Share,
             allowance: Share) -> CellStep:
    """Move the share toward ``target``, growing no figure by more than ``allowance``."""
    return _step(client, tenant_id, "set", floor, target, allowance)


# -- the rebalance ----------------------------------------------------------------------------


@dataclass
class Rebalance:
    """What one rebalance of one tenant did; ``skipped`` names why nothing moved."""

    tenant_id: object
    shares: dict[str, Share] = dataclasses.field(default_factory=dict)  # upper bounds after
    demand: dict[str, float] = dataclasses.field(default_factory=dict)
    skipped: str = ""
    failed: list[str] = dataclasses.field(default_factory=list)  # cells a step failed in


def rebalance(tenant_id: object, quota: Share, clients: Mapping[str, redis.Redis], *,
              floor: float, wait_replicas: int = 0) -> Rebalance:
    """One rebalance of one tenant over its cells (name -> that cell's Redis), in three phases.

    1. read every cell's share and demand; any cell unreachable: change nothing (its share is
       unknown, so no headroom can be computed);
    2. shrink every cell to min(share, target) (allowance 0);
    3. grow cells toward their targets from the headroom: quota minus the sum of upper bounds.

    Only one rebalancer may run at a time (the caller holds a lock); the shares are changed by
    nothing else except a lost Redis state, which only lowers them to the floor (C4).
    """
    result = Rebalance(tenant_id)
    cells = list(clients)
    base = floor_share(quota, len(cells), floor)
    current = read_phase(tenant_id, clients, base, result)
    if current is None:
        return result
    targets = plan(quota, result.demand, floor)
    if targets is None:
        result.skipped = "no demand"
        result.shares = current
        return result
    bounds = shrink_phase(tenant_id, clients, base, targets, current, result,
                          wait_replicas=wait_replicas)
    result.shares = grow_phase(tenant_id, quota, clients, base, targets, bounds, result)
    return result


def read_phase(tenant_id: object, clients: Mapping[str, redis.Redis], base: Share,
               result: Rebalance) -> dict[str, Share] | None:
    current: dict[str, Share] = {}
    for cell, client in clients.items():
        try:
            step = read_cell(client, tenant_id, base)
        except redis.RedisError:
            result.skipped = f"cell {cell} unreachable"
            return None
        current[cell], result.demand[cell] = step.before, step.demand
    return current


def shrink_phase(tenant_id: object, clients: Mapping[str, redis.Redis], base: Share,
                 targets: Mapping[str, Share], current: Mapping[str, Share],
                 result: Rebalance, *, wait_replicas: int = 0) -> dict[str, Share]:
    """Shrink each cell; returns an upper bound of each cell's share afterwards."""
    bounds = dict(current)
    for cell, client in clients.items():
        if targets[cell].lower(current[cell]) == current[cell]:
            continue  # nothing to shrink here
        try:
            step = set_cell(client, tenant_id, base, targets[cell], ZERO)
            if wait_replicas and int(client.wait(wait_replicas, 1000)) < wait_replicas:
                # A failover could still bring the larger share back: keep it as the bound.
                raise redis.RedisError("the shrink reached too few replicas")
            bounds[cell] = step.after  # exact: the script applied it atomically
        except redis.RedisError:
            result.failed.append(cell)  # applied or not: the old share stays its bound
    return bounds


def grow_phase(tenant_id: object, quota: Share, clients: Mapping[str, redis.Redis], base: Share,
               targets: Mapping[str, Share], bounds: Mapping[str, Share],
               result: Rebalance) -> dict[str, Share]:
    """Grow cells toward their targets, each by at most the headroom left (C2)."""
    bounds = dict(bounds)
    headroom = quota.minus(total(bounds)).at_least_zero()
    for cell, client in clients.items():
        want = targets[cell].minus(bounds[cell]).at_least_zero()
        if want == ZERO:
            continue
        allowance = want.lower(headroom)
        try:
            step = set_cell(client, tenant_id, base, targets[cell], allowance)
        except redis.RedisError:
            # It may have grown by the whole allowance before the reply was lost.
            result.failed.append(cell)
            bounds[cell] = bounds[cell].plus(allowance)
            headroom = headroom.minus(allowance).at_least_zero()
            continue
        grown = step.after.minus(step.before).at_least_zero()
        bounds[cell] = step.after
        headroom = headroom.minus(grown).at_least_zero()
    return bounds


# -- the gateway's side -----------------------------------------------------------------------


def split_limits(limits: AdmissionLimits, quota: Share, n_cells: int,
                 floor: float) -> AdmissionLimits:
    """A split tenant's admission limits in one cell.

    Its token buckets are passed the floor share, which admit.lua replaces by the share the
    rebalancer recorded (C1); so a cell whose Redis holds none yet (or lost it) enforces the
    floor, which is never more than what the rebalancer counts for it. Concurrency and open
    streams are split evenly (rounded up: at most n_cells - 1 above the tenant's limit in all).
    """
    base = floor_share(quota, n_cells, floor)
    tenant = limits.tenant

    def part(value: int | None) -> int | None:
        return None if value is None else max(1, math.ceil(value / n_cells))

    tenant = dataclasses.replace(
        tenant, input_tpm=int(base.in_rate), input_burst=int(base.in_burst),
        output_tpm=int(base.out_rate), output_burst=int(base.out_burst),
        concurrent_requests=part(tenant.concurrent_requests),
        open_streams=part(tenant.open_streams))
    return dataclasses.replace(limits, tenant=tenant)


async def record_demand_async(client: aioredis.Redis, tenant_id: object, tokens: int) -> None:
    """Count tokens requested in this cell (a hint for the next rebalance, not accounting)."""
    await client.hincrby(_share_keys(tenant_id)[1], "demand", max(0, int(tokens)))


def record_demand(client: redis.Redis, tenant_id: object, tokens: int) -> None:
    client.hincrby(_share_keys(tenant_id)[1], "demand", max(0, int(tokens)))
