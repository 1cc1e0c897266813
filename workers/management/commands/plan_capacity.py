"""``manage.py plan_capacity``: size a pool with the design's capacity arithmetic.

Either give the geometry on the command line (the design's example)::

    manage.py plan_capacity --layers 32 --kv-heads 8 --head-dim 128 --bytes 2 --params 8e9 \\
        --gpu-gb 80 --kv-budget-gb 50 --avg-context 4000 --decode-tps 32 \\
        --demand-tpm 2000000 --spare 2

or read it from a pool's model (``--pool NAME``); flags given next to ``--pool`` override the
pool's values. ``--json`` prints the figures as JSON for scripts.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from catalog.capacity import PlanError, PlanInput, input_for_pool, plan, render_text
from catalog.models import Pool

# flag dest -> PlanInput field
_FLAGS = {
    "layers": "layers", "kv_heads": "kv_heads", "head_dim": "head_dim",
    "bytes": "bytes_per_value", "params": "parameters", "weight_bytes": "weight_bytes_per_param",
    "gpu_gb": "gpu_gb", "kv_budget_gb": "kv_budget_gb", "gpu_util": "gpu_memory_utilization",
    "overhead_gb": "overhead_gb", "avg_context": "avg_context", "decode_tps": "decode_tps",
    "demand_tpm": "demand_tpm", "spare": "spare", "long_prompt": "long_prompt",
}


class Command(BaseCommand):
    help = "KV bytes per token, tokens in memory, concurrent sequences and replicas for a pool."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--pool", help="Read the geometry from this pool's model.")
        ints = ("layers", "kv-heads", "head-dim", "bytes", "avg-context", "spare", "long-prompt")
        for name in ints:
            parser.add_argument(f"--{name}", type=int)
        floats = ("params", "weight-bytes", "gpu-gb", "kv-budget-gb", "gpu-util", "overhead-gb",
                  "decode-tps", "demand-tpm")
        for name in floats:
            parser.add_argument(f"--{name}", type=float)
        parser.add_argument("--json", action="store_true", help="Print the figures as JSON.")

    def handle(self, *args: Any, **opts: Any) -> None:
        given = {field: opts[dest] for dest, field in _FLAGS.items() if opts.get(dest) is not None}
        try:
            inputs = self._inputs(opts.get("pool"), given)
            result = plan(inputs)
        except PlanError as exc:
            raise CommandError(str(exc)) from exc
        if opts["json"]:
            self.stdout.write(json.dumps(result.as_dict(), indent=2))
        else:
            self.stdout.write(render_text(result))

    @staticmethod
    def _inputs(pool_name: str | None, given: dict[str, Any]) -> PlanInput:
        if pool_name:

            pool = Pool.objects.select_related("model").filter(name=pool_name).first()
            if pool is None:
                raise CommandError(f"no pool named {pool_name!r}")
            return input_for_pool(pool, **given)
        missing = [f"--{f.replace('_', '-')}" for f in ("layers", "kv_heads", "head_dim")
                   if f not in given]
        if missing:
            raise CommandError(f"give {', '.join(missing)} (or --pool NAME)")
        return PlanInput(**given)
