"""Build a pool's engine: ``build_engine(pool or spec) -> Engine`` for every backend.

A pool names its backend (``simulated``, ``vllm``, ``openai_upstream``) and carries that
backend's settings in ``backend_settings`` (JSON, edited in the admin). Settings are checked
here, by name and type, before anything starts, so a typo fails the worker's start-up with a
message naming the pool and the key instead of a traceback from deep inside an engine.

Keys every backend accepts:
- ``capacity``: planner inputs for this pool (``catalog.capacity.POOL_PLAN_KEYS``);
- ``lora`` (vllm, openai_upstream): ``{"enabled", "max_loras", "max_lora_rank", "adapter_root",
  "adapters": [{"name", "tenant_id", "path", "upstream_model"}]}`` (``serving.adapters``).

See ``docs/deployment.md`` for each backend's keys with examples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from catalog.models import Pool
from serving.adapters import AdapterCatalog, AdapterConfigError
from workers.engine.base import Engine
from workers.engine.simulated import Fault, SimConfig, SimulatedEngine
from workers.engine.upstream import UpstreamEngine, UpstreamSettings
from workers.engine.vllm_backend import VLLMEngine, VLLMSettings

BACKENDS = ("simulated", "vllm", "openai_upstream")
NUM = (int, float)

SIM_KEYS: dict[str, Any] = {
    "decode_tokens_per_s": NUM, "pool_tokens_per_s": (*NUM, type(None)),
    "prefill_tokens_per_s": NUM, "prefill_chunk_tokens": int, "step_overhead_s": NUM,
    "max_num_batched_tokens": int, "long_prefill_token_threshold": int,
    "max_num_partial_prefills": int,
    "block_size": int, "seed": int, "enable_prefix_caching": bool, "kv_watermark": NUM,
    "fail_request_ids": list, "faults": list, "embedding_dim": int,
}
VLLM_KEYS: dict[str, Any] = {
    "model": str, "tokenizer_path": str, "gpu_memory_utilization": NUM,
    "enable_prefix_caching": bool, "scheduling_policy": str, "dtype": str,
    "tensor_parallel_size": int, "block_size": int, "max_num_batched_tokens": int,
    "long_prefill_token_threshold": int, "max_num_partial_prefills": int,
    "prefill_tokens_per_s": NUM, "kv_cache_dtype": str, "enforce_eager": bool, "seed": int,
    "engine_args": dict,
    "kv_cache_memory_bytes": int,
}
UPSTREAM_KEYS: dict[str, Any] = {
    "base_url": str, "model": str, "dialect": str, "prompt_format": str,
    "send_cache_salt": bool, "return_token_ids": bool, "include_usage": bool,
    "vllm_sampling": bool, "send_priority": bool, "api_key_env": str,
    "connect_timeout_s": NUM, "first_byte_timeout_s": NUM, "idle_timeout_s": NUM,
    "max_connections": int, "extra_body": dict,
}
LORA_KEYS: dict[str, Any] = {
    "enabled": bool, "max_loras": int, "max_lora_rank": int, "adapter_root": str,
    "adapters": list,
}
COMMON_KEYS: dict[str, Any] = {"capacity": dict}


class EngineConfigError(RuntimeError):
    """The pool's engine cannot be built from its settings (the message says why)."""


@dataclass(frozen=True)
class EngineSpec:
    """A pool's engine as a worker builds and hosts it: read once from its ``Pool`` row and model.

    One type for both jobs: ``build_engine`` reads the backend and its settings, the engine host
    (``workers.host``) the slot and KV capacity it dispatches into.
    """

    name: str
    backend: str = "simulated"
    backend_settings: dict[str, Any] = field(default_factory=dict)
    max_sequences: int = 64
    kv_cache_tokens: int = 381_000
    kv_overcommit: float = 1.0
    max_model_len: int = 8192
    tokenizer_path: str = ""
    model_id: str = ""  # ServedModel.engine_model_id: the path or id the engine loads
    dedicated: bool = False  # the pool serves one tenant only
    task: str = "generate"  # ServedModel.task: "embed" runs vLLM's pooling runner

    @classmethod
    def from_pool(cls, pool: Any) -> EngineSpec:
        m = pool.model
        return cls(
            name=pool.name, backend=pool.backend,
            backend_settings=dict(pool.backend_settings or {}),
            max_sequences=pool.max_sequences, kv_cache_tokens=pool.kv_cache_tokens,
            kv_overcommit=pool.kv_overcommit, max_model_len=m.max_model_len,
            tokenizer_path=m.tokenizer_path or "", model_id=m.engine_model_id or "",
            dedicated=pool.dedicated_to_id is not None, task=m.task,
        )

    @classmethod
    def load(cls, name: str) -> EngineSpec:
        """The enabled pool ``name`` from the database; EngineConfigError saying why not."""
        pool = Pool.objects.select_related("model").filter(name=name).first()
        if pool is None:
            raise EngineConfigError(f"no pool named {name!r} (create it in the admin first)")
        if not pool.enabled:
            raise EngineConfigError(f"pool {name!r} is disabled")
        return cls.from_pool(pool)

    @classmethod
    def coerce(cls, obj: Any) -> EngineSpec:
        """A spec from a Pool, an EngineSpec, or any object with the same fields."""
        if isinstance(obj, EngineSpec):
            return obj
        if hasattr(obj, "dedicated_to_id") and hasattr(obj, "model"):
            return cls.from_pool(obj)
        names = ("backend", "backend_settings", "max_sequences", "kv_cache_tokens",
                 "kv_overcommit", "max_model_len", "tokenizer_path", "model_id", "dedicated",
                 "task")
        values = {n: getattr(obj, n) for n in names if hasattr(obj, n)}
        values["backend_settings"] = dict(values.get("backend_settings") or {})
        return cls(name=obj.name, **values)


def _check(pool: str, where: str, values: dict[str, Any], schema: dict[str, Any]) -> None:
    unknown = set(values) - set(schema)
    if unknown:
        raise EngineConfigError(
            f"pool {pool!r}: unknown {where} settings {sorted(unknown)}; known: {sorted(schema)}")
    for key, value in values.items():
        kinds = schema[key]
        bad_bool = isinstance(value, bool) and bool not in (
            kinds if isinstance(kinds, tuple) else (kinds,))
        if not isinstance(value, kinds) or bad_bool:
            raise EngineConfigError(
                f"pool {pool!r}: {where} setting {key!r} has the wrong type "
                f"({type(value).__name__})")


def validate(spec: EngineSpec) -> None:
    """Check the pool's backend and settings without building anything."""
    if spec.backend not in BACKENDS:
        raise EngineConfigError(
            f"pool {spec.name!r}: unknown backend {spec.backend!r}; known: {list(BACKENDS)}")
    schema = {"simulated": SIM_KEYS, "vllm": VLLM_KEYS, "openai_upstream": UPSTREAM_KEYS}
    keys = {**schema[spec.backend], **COMMON_KEYS}
    if spec.backend != "simulated":
        keys["lora"] = dict
    _check(spec.name, spec.backend, spec.backend_settings, keys)
    lora = spec.backend_settings.get("lora")
    if lora:
        _check(spec.name, "lora", lora, LORA_KEYS)


def adapter_catalog(spec: Any) -> AdapterCatalog:
    """The pool's LoRA adapters (for the API layer: ``resolve`` and ``visible_names``)."""
    spec = EngineSpec.coerce(spec)
    try:
        return AdapterCatalog.of_pool(spec.name, spec.backend, spec.backend_settings)
    except AdapterConfigError as exc:
        raise EngineConfigError(f"pool {spec.name!r}: {exc}") from exc


def build_engine(pool: Any, clock: Any = None) -> Engine:
    """The engine for a pool (a ``Pool`` row or an ``EngineSpec``).

    ``clock`` is for the simulated engine (virtual time in simulations); real engines ignore it.
    """
    spec = EngineSpec.coerce(pool)
    validate(spec)
    builders = {"simulated": _simulated, "vllm": _vllm, "openai_upstream": _upstream}
    try:
        return builders[spec.backend](spec, clock)
    except (TypeError, ValueError) as exc:
        raise EngineConfigError(f"pool {spec.name!r}: bad backend settings: {exc}") from exc


def _simulated(spec: EngineSpec, clock: Any) -> Engine:
    extra = {k: v for k, v in spec.backend_settings.items() if k in SIM_KEYS}
    if "fail_request_ids" in extra:
        extra["fail_request_ids"] = frozenset(extra["fail_request_ids"])
    if "faults" in extra:
        extra["faults"] = fault_rules(extra["faults"])
    config = SimConfig(max_running_seqs=spec.max_sequences, kv_cache_tokens=spec.kv_cache_tokens,
                       max_model_len=spec.max_model_len,
                       model_dir=spec.tokenizer_path or None, **extra)
    return SimulatedEngine(config, clock)


def fault_rules(rules: list[Any]) -> Any:
    """Fault injection for tests and drills: ``[{"seed": 666, "kind": "error", "after_tokens":
    3, "seconds": 0}]`` fails every request sent with that sampling ``seed``.

    Keyed on the seed because a client can choose it per request while the rule itself lives in
    the pool's settings (admin only), so a tenant can trigger a fault only where an operator
    configured one; a pool without ``faults`` is unaffected.
    """
    table: dict[int, Fault] = {}
    for rule in rules:
        if not isinstance(rule, dict) or not isinstance(rule.get("seed"), int):
            raise ValueError("each fault needs an integer 'seed'")
        if rule.get("kind") not in ("error", "stall", "invalid_tokens"):
            raise ValueError("fault kind must be error, stall or invalid_tokens")
        table[rule["seed"]] = Fault(rule["kind"], int(rule.get("after_tokens", 0)),
                                    float(rule.get("seconds", 0.0)),
                                    bool(rule.get("retryable", True)))
    return lambda req: table.get(req.sampling.seed) if req.sampling.seed is not None else None


def _vllm(spec: EngineSpec, clock: Any) -> Engine:
    s = spec.backend_settings
    lora = s.get("lora") or {}
    model = s.get("model") or spec.model_id
    if not model:
        raise EngineConfigError(f"pool {spec.name!r}: no model path (set the model's engine "
                                "model id, or backend_settings.model)")
    values = {k: v for k, v in s.items() if k in VLLM_KEYS and k != "model"}
    values.setdefault("tokenizer_path", spec.tokenizer_path or None)
    settings = VLLMSettings(
        model=model, max_model_len=spec.max_model_len, max_num_seqs=spec.max_sequences,
        kv_cache_tokens=spec.kv_cache_tokens,
        enable_lora=bool(lora.get("enabled", False)),
        max_loras=int(lora.get("max_loras", 4)), max_lora_rank=int(lora.get("max_lora_rank", 16)),
        embed=spec.task == "embed",
        **values,
    )
    return VLLMEngine(settings, adapter_catalog(spec))


def _upstream(spec: EngineSpec, clock: Any) -> Engine:
    s = dict(spec.backend_settings)
    if not s.get("base_url"):
        raise EngineConfigError(f"pool {spec.name!r}: openai_upstream needs base_url")
    values = {k: v for k, v in s.items() if k in UPSTREAM_KEYS and k != "dialect"}
    values.setdefault("model", spec.model_id)
    values.setdefault("max_connections", spec.max_sequences)
    settings = UpstreamSettings.for_dialect(s.get("dialect", "vllm"),
                                            max_model_len=spec.max_model_len, **values)
    if not settings.send_cache_salt and not spec.dedicated:
        # Without a salt the upstream's prefix cache is shared by everyone it serves: one tenant
        # could time another's prompts (I1). Only a pool that serves one tenant may do that.
        raise EngineConfigError(
            f"pool {spec.name!r}: this upstream gets no cache_salt (dialect "
            f"{settings.dialect!r}), so its prefix cache would be shared across tenants (I1); "
            "dedicate the pool to one tenant, or front a server that honours cache_salt")
    return UpstreamEngine(settings, spec.tokenizer_path or None, adapter_catalog(spec))


def check_pool_settings(name: str, backend: str, backend_settings: dict[str, Any],
                        dedicated: bool) -> None:
    """The Pool admin's check (``workers.admin``, ``create_pool``): ValueError naming the key."""
    spec = EngineSpec(name=name, backend=backend, backend_settings=backend_settings,
                      dedicated=dedicated)
    try:
        validate(spec)
        if spec.backend == Pool.Backend.OPENAI_UPSTREAM and not backend_settings.get("base_url"):
            raise EngineConfigError("openai_upstream needs 'base_url' (the server's /v1 URL)")
        adapter_catalog(spec)
    except EngineConfigError as exc:
        raise ValueError(str(exc)) from exc
