"""``manage.py plan_redis``: the Redis shards and cells a demand needs.

The cost comes from a measurement (``bench/redis_cost.py --json cost.json``) or from flags::

    manage.py plan_redis --cost cost.json --demand-tpm 2e6 2e7
    manage.py plan_redis --cpu-us-per-request 800 --cpu-us-per-token 7.5 \\
        --commands-per-request 109 --commands-per-token 1.42 --demand-tpm 2e7

``--json`` prints the plans as JSON for scripts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from catalog.redis_capacity import (
    RedisCost,
    RedisPlanError,
    plan_redis,
    render_redis_text,
)


class Command(BaseCommand):
    help = "Redis shards and cells for a demand in output tokens per minute."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--cost", help="JSON written by bench/redis_cost.py --json")
        parser.add_argument("--cpu-us-per-request", type=float)
        parser.add_argument("--cpu-us-per-token", type=float)
        parser.add_argument("--commands-per-request", type=float, default=0.0)
        parser.add_argument("--commands-per-token", type=float, default=0.0)
        parser.add_argument("--demand-tpm", type=float, nargs="+", default=[2e6, 2e7],
                            help="output tokens per minute (default: the design's 2M and 20M)")
        parser.add_argument("--tokens-per-request", type=float, default=330.0)
        parser.add_argument("--shard-cpu", type=float, default=0.5,
                            help="fraction of its one core a Redis shard may use at peak")
        parser.add_argument("--replica-tps", type=float, default=3040.0,
                            help="output tokens/s of one engine replica (plan_capacity)")
        parser.add_argument("--max-replicas-per-cell", type=int, default=50)
        parser.add_argument("--shards-per-cell", type=int, default=1,
                            help="Redis primaries one cell may run (1 without Redis Cluster)")
        parser.add_argument("--regions", type=int, default=1,
                            help="regions served: at least one cell each")
        parser.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **opts: Any) -> None:
        try:
            cost = self._cost(opts)
            plans = [plan_redis(cost, output_tpm=d, tokens_per_request=opts["tokens_per_request"],
                                shard_cpu=opts["shard_cpu"],
                                replica_tokens_per_s=opts["replica_tps"],
                                max_replicas_per_cell=opts["max_replicas_per_cell"],
                                shards_per_cell=opts["shards_per_cell"], regions=opts["regions"])
                     for d in opts["demand_tpm"]]
        except RedisPlanError as exc:
            raise CommandError(str(exc)) from None
        if opts["json"]:
            self.stdout.write(json.dumps({"cost": cost.__dict__,
                                          "plans": [p.as_dict() for p in plans]}, indent=2))
        else:
            self.stdout.write(render_redis_text(cost, plans))

    def _cost(self, opts: dict[str, Any]) -> RedisCost:
        if opts["cost"]:
            try:
                data = json.loads(Path(opts["cost"]).read_text())
            except (OSError, ValueError) as exc:
                raise CommandError(f"--cost {opts['cost']}: {exc}") from None
            return RedisCost.from_dict(data.get("cost", data))
        if opts["cpu_us_per_request"] is None or opts["cpu_us_per_token"] is None:
            raise CommandError("give --cost FILE (bench/redis_cost.py --json) or both "
                               "--cpu-us-per-request and --cpu-us-per-token")
        return RedisCost(cpu_s_per_request=opts["cpu_us_per_request"] / 1e6,
                         cpu_s_per_token=opts["cpu_us_per_token"] / 1e6,
                         commands_per_request=opts["commands_per_request"],
                         commands_per_token=opts["commands_per_token"])
