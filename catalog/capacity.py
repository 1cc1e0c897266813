"""The capacity planner: the design's "Capacity estimate" as a function of a model and a fleet.

From a model's geometry (layers, KV heads, head dimension, bytes per value) and size, the
accelerator's memory and the measured decode rate, it answers the design's questions:

- KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per value;
- tokens of context in memory = KV budget / bytes per token (50 GB / 128 KiB ~ 381,000);
- concurrent sequences = tokens in memory / average context (95 at 4,000 tokens);
- replicas = demand (tokens/s) / (sequences x per-stream decode rate), rounded up, plus spares
  for failures and rolling deploys (11 + 2 = 13 for 2 million output tokens per minute);
- what one long prompt costs: its KV bytes, its share of the budget, the average sequences it
  displaces while it runs (128,000 tokens -> 16.8 GB, about 32 sequences).

The KV budget is either given (the design assumes 50 GB) or derived the way vLLM sizes it:
accelerator memory x ``gpu_memory_utilization`` - weights - runtime overhead (activations, CUDA
graphs). vLLM's default utilisation of 0.9 and 6 GB of overhead give the design's 50 GB on an
80 GB accelerator with 16 GB of weights. Decimal GB (10^9) throughout, as the design uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from catalog.geometry import kv_bytes_per_token, kv_tokens_in_memory

GB = 10**9
KIB = 1024
# Average contexts the design tabulates ("how fast concurrency collapses").
CONTEXT_LADDER = (4_000, 8_000, 16_000, 32_000, 128_000)


class PlanError(ValueError):
    """The inputs cannot describe a working deployment (the weights do not fit, ...)."""


@dataclass(frozen=True)
class PlanInput:
    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_value: int = 2
    parameters: float = 8e9
    weight_bytes_per_param: float | None = None  # None: the KV precision (16-bit weights)
    gpu_gb: float = 80.0
    kv_budget_gb: float | None = None  # None: derived from utilisation and overhead
    gpu_memory_utilization: float = 0.9
    overhead_gb: float = 6.0
    avg_context: int = 4_000
    decode_tps: float = 32.0  # measured output tokens per second per stream at this batch size
    demand_tpm: float = 2_000_000.0  # peak output tokens per minute across all tenants
    spare: int = 2  # replicas for failures and rolling deploys
    long_prompt: int = 128_000
    max_model_len: int | None = None
    ladder: tuple[int, ...] = CONTEXT_LADDER

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "bytes_per_value", "avg_context"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be at least 1")
        for name in ("parameters", "gpu_gb", "decode_tps"):
            if getattr(self, name) <= 0:
                raise PlanError(f"{name} must be positive")
        if self.demand_tpm < 0 or self.spare < 0 or self.overhead_gb < 0:
            raise PlanError("demand_tpm, spare and overhead_gb may not be negative")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise PlanError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_budget_gb is not None and self.kv_budget_gb <= 0:
            raise PlanError("kv_budget_gb must be positive")


@dataclass(frozen=True)
class CapacityPlan:
    inputs: PlanInput
    kv_bytes_per_token: int
    weights_bytes: float
    kv_budget_bytes: float
    kv_budget_derived: bool
    tokens_in_memory: int
    sequences: int  # concurrent sequences at the average context
    ladder: dict[int, int]  # average context -> concurrent sequences
    replica_tokens_per_s: float
    demand_tokens_per_s: float
    concurrent_streams: int  # streams the demand needs at the per-stream decode rate
    replicas: int
    replicas_by_memory: int  # the same answer from memory: streams / sequences per replica
    total_replicas: int
    long_prompt_bytes: int
    long_prompt_share: float  # of the KV budget
    long_prompt_displaces: float  # average sequences pushed out while it runs
    warnings: list[str] = field(default_factory=list)

    def pool_settings(self) -> dict[str, int]:
        """What to enter on the Pool: KV tokens and running sequences per engine instance."""
        return {"kv_cache_tokens": self.tokens_in_memory, "max_sequences": self.sequences}

    def as_dict(self) -> dict[str, Any]:
        return {
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_kib_per_token": self.kv_bytes_per_token / KIB,
            "weights_gb": self.weights_bytes / GB,
            "kv_budget_gb": self.kv_budget_bytes / GB,
            "tokens_in_memory": self.tokens_in_memory,
            "sequences": self.sequences,
            "ladder": self.ladder,
            "replica_tokens_per_s": self.replica_tokens_per_s,
            "demand_tokens_per_s": self.demand_tokens_per_s,
            "concurrent_streams": self.concurrent_streams,
            "replicas": self.replicas,
            "replicas_by_memory": self.replicas_by_memory,
            "total_replicas": self.total_replicas,
            "long_prompt_gb": self.long_prompt_bytes / GB,
            "long_prompt_share": self.long_prompt_share,
            "long_prompt_displaces": self.long_prompt_displaces,
            "warnings": list(self.warnings),
        }


def _kv_budget(p: PlanInput, weights: float) -> tuple[float, bool]:
    if p.kv_budget_gb is not None:
        return p.kv_budget_gb * GB, False
    usable = p.gpu_gb * GB * p.gpu_memory_utilization - weights - p.overhead_gb * GB
    if usable <= 0:
        raise PlanError(
            f"no memory left for the KV cache: {p.gpu_gb:g} GB x {p.gpu_memory_utilization:g} "
            f"minus {weights / GB:.1f} GB of weights and {p.overhead_gb:g} GB of overhead"
        )
    return usable, True


def _replicas(demand_tps: float, per_replica_tps: float) -> int:
    # round() first so 10.9999999 from float noise does not become 11 when it means 11 exactly.
    return math.ceil(round(demand_tps / per_replica_tps, 9)) if demand_tps else 0


def plan(p: PlanInput) -> CapacityPlan:
    per_token = kv_bytes_per_token(p.layers, p.kv_heads, p.head_dim, p.bytes_per_value)
    weights = p.parameters * (p.weight_bytes_per_param or p.bytes_per_value)
    if weights >= p.gpu_gb * GB:
        raise PlanError(f"the weights ({weights / GB:.1f} GB) do not fit in {p.gpu_gb:g} GB")
    budget, derived = _kv_budget(p, weights)
    warnings: list[str] = []
    if weights + budget > p.gpu_gb * GB:
        warnings.append("weights + KV budget exceed the accelerator's memory")
    tokens = kv_tokens_in_memory(budget, per_token)
    seqs = tokens // p.avg_context
    if seqs < 1:
        raise PlanError(
            f"not one sequence of {p.avg_context:,} tokens fits in {tokens:,} tokens of KV cache"
        )
    if p.max_model_len and p.max_model_len > tokens:
        warnings.append(
            f"max_model_len {p.max_model_len:,} exceeds the {tokens:,} tokens of KV cache: "
            "vLLM refuses to start"
        )
    replica_tps = seqs * p.decode_tps
    demand_tps = p.demand_tpm / 60
    streams = math.ceil(round(demand_tps / p.decode_tps, 9))
    replicas = _replicas(demand_tps, replica_tps)
    long_bytes = p.long_prompt * per_token
    return CapacityPlan(
        inputs=p,
        kv_bytes_per_token=per_token,
        weights_bytes=weights,
        kv_budget_bytes=budget,
        kv_budget_derived=derived,
        tokens_in_memory=tokens,
        sequences=seqs,
        ladder={ctx: tokens // ctx for ctx in p.ladder},
        replica_tokens_per_s=replica_tps,
        demand_tokens_per_s=demand_tps,
        concurrent_streams=streams,
        replicas=replicas,
        replicas_by_memory=_replicas(streams, seqs),
        total_replicas=replicas + p.spare if replicas else 0,
        long_prompt_bytes=long_bytes,
        long_prompt_share=long_bytes / budget,
        long_prompt_displaces=p.long_prompt / p.avg_context,
        warnings=warnings,
    )


# Planner inputs a pool may carry in ``backend_settings["capacity"]`` (the rest come from the
# pool's model geometry and vLLM settings).
POOL_PLAN_KEYS = frozenset({
    "gpu_gb", "kv_budget_gb", "overhead_gb", "avg_context", "decode_tps", "demand_tpm", "spare",
    "long_prompt", "weight_bytes_per_param",
})


def input_for_pool(pool: Any, **overrides: Any) -> PlanInput:
    """Planner inputs from a ``catalog.models.Pool`` (its model's geometry) plus overrides."""
    m = pool.model
    settings = dict(pool.backend_settings or {})
    stored = settings.get("capacity") or {}
    if not isinstance(stored, dict):
        raise PlanError('backend_settings["capacity"] must be an object')
    unknown = set(stored) - POOL_PLAN_KEYS
    if unknown:
        raise PlanError(f'unknown capacity settings {sorted(unknown)}; known: '
                        f'{sorted(POOL_PLAN_KEYS)}')
    values: dict[str, Any] = {
        "layers": m.num_layers, "kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
        "bytes_per_value": m.bytes_per_value, "parameters": float(m.parameter_count),
        "max_model_len": m.max_model_len,
    }
    if "gpu_memory_utilization" in settings:
        values["gpu_memory_utilization"] = float(settings["gpu_memory_utilization"])
    values.update(stored)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return PlanInput(**values)


def render_text(result: CapacityPlan) -> str:
    """The plan as the design writes it, one line per step of the arithmetic."""
    p = result.inputs
    kib = result.kv_bytes_per_token / KIB
    lines = [
        f"KV cache per token: 2 x {p.layers} layers x {p.kv_heads} KV heads x {p.head_dim} x "
        f"{p.bytes_per_value} bytes = {result.kv_bytes_per_token:,} bytes = {kib:g} KiB",
        f"weights: {p.parameters:.3g} parameters x "
        f"{p.weight_bytes_per_param or p.bytes_per_value:g} bytes = "
        f"{result.weights_bytes / GB:.1f} GB of {p.gpu_gb:g} GB",
        f"KV budget: {result.kv_budget_bytes / GB:.1f} GB"
        + (f" ({p.gpu_gb:g} GB x {p.gpu_memory_utilization:g} - weights - "
           f"{p.overhead_gb:g} GB overhead)" if result.kv_budget_derived else " (given)"),
        f"tokens of context in memory: {result.tokens_in_memory:,}",
        f"concurrent sequences at {p.avg_context:,} tokens: {result.sequences}",
        "by average context: " + ", ".join(
            f"{ctx:,} -> {n}" for ctx, n in result.ladder.items()),
        f"per replica: {result.sequences} x {p.decode_tps:g} tok/s = "
        f"{result.replica_tokens_per_s:,.0f} output tokens/s",
        f"demand: {p.demand_tpm:,.0f} tokens/min = {result.demand_tokens_per_s:,.0f} tokens/s "
        f"-> {result.replicas} replicas (by memory: {result.concurrent_streams:,} streams / "
        f"{result.sequences} = {result.replicas_by_memory})",
        f"with {p.spare} spare: {result.total_replicas} replicas",
        f"a {p.long_prompt:,}-token prompt: {result.long_prompt_bytes / GB:.1f} GB, "
        f"{result.long_prompt_share:.0%} of the KV budget, displacing about "
        f"{result.long_prompt_displaces:.0f} average sequences",
        f"pool settings: kv_cache_tokens={result.tokens_in_memory}, "
        f"max_sequences={result.sequences}",
    ]
    lines += [f"warning: {w}" for w in result.warnings]
    return "\n".join(lines)
