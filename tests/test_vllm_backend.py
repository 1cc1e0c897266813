"""The vLLM backend: request building (salt, adapters, priority), streaming, abort, load.

- the pure translation ``EngineRequest -> generate() arguments`` is tested as data;
- failure paths that a real engine cannot be made to take on demand (an error mid-stream, a
  tokenizer vLLM reports differently) run against a fake ``AsyncLLM`` that keeps vLLM's
  contract (DELTA outputs; cancelling the consumer aborts): unit tests of this one module;
- the rest runs against vLLM itself: its own classes, and the run's shared engine (vLLM's CPU
  build serving the tiny model, ``tests/vllm_fixtures.py``) for load from the scheduler, the
  adapter checks, the vocabulary check and CPU memory sizing. The shared contract (streaming,
  abort, usage, salts, priority, adapters) is in ``test_engine_conformance.py``.

Where vLLM is not installed the vLLM tests skip, saying how to install it.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from serving.adapters import Adapter, AdapterCatalog
from serving.tokenization import load_tokenizer, sim_model_dir
from tests.vllm_fixtures import MISSING
from workers.engine.base import EngineError, EngineRequest, FinishReason, SamplingParams
from workers.engine.registry import EngineConfigError, EngineSpec, build_engine
from workers.engine.vllm_backend import (
    GenerateCall,
    LoadSink,
    VLLMEngine,
    VLLMSettings,
    build_generate_call,
    map_error,
)

TOK = load_tokenizer()
VOCAB = TOK.vocab_size
IDS = TOK.encode("Adapters are tenant data; prefix caches are scoped per tenant.")
SIM_DIR = str(sim_model_dir())
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason=MISSING)

OWNER_SALT, OTHER_SALT = "salt-of-7", "salt-of-8"
CATALOG = AdapterCatalog([Adapter("support", 7, "/loras/7/support"),
                          Adapter("support", 9, "/loras/9/support")],
                         salt_of=lambda t: f"salt-of-{t}")


def adapter_dirs(root: Path) -> AdapterCatalog:
    """CATALOG's adapters with their files present under ``root``."""
    adapters = []
    for a in CATALOG:
        path = root / str(a.tenant_id) / a.name
        path.mkdir(parents=True)
        (path / "adapter_config.json").write_text("{}")
        adapters.append(Adapter(a.name, a.tenant_id, str(path)))
    return AdapterCatalog(adapters, salt_of=lambda t: f"salt-of-{t}")


def vsettings(**kw: Any) -> VLLMSettings:
    base: dict[str, Any] = {"model": SIM_DIR, "max_model_len": 4096, "max_num_seqs": 8}
    return VLLMSettings(**{**base, **kw})


def req(rid: str = "r1", salt: str = OWNER_SALT, max_tokens: int = 16, **kw: Any) -> EngineRequest:
    adapter, priority = kw.pop("adapter", None), kw.pop("priority", 0)
    ids = kw.pop("ids", IDS)
    return EngineRequest(rid, list(ids), SamplingParams(max_tokens=max_tokens, **kw),
                         cache_salt=salt, adapter=adapter, priority=priority)


def build(request: EngineRequest, **kw: Any) -> GenerateCall:
    return build_generate_call(request, vsettings(**kw), CATALOG, VOCAB)


# -- engine settings -------------------------------------------------------------------------


def test_engine_args_come_from_the_pool_and_never_log_prompts() -> None:
    args = vsettings(gpu_memory_utilization=0.85, enable_prefix_caching=True, enable_lora=True,
                     max_loras=2, max_lora_rank=32, scheduling_policy="priority",
                     engine_args={"swap_space": 0}).async_engine_args()
    assert args["model"] == SIM_DIR and args["tokenizer"] == SIM_DIR
    assert (args["max_model_len"], args["max_num_seqs"]) == (4096, 8)
    assert args["gpu_memory_utilization"] == 0.85
    assert args["enable_prefix_caching"] is True
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"]) == (True, 2, 32)
    assert args["scheduling_policy"] == "priority"
    assert args["disable_log_stats"] is False  # load() needs the scheduler stats
    assert args["enable_log_requests"] is False  # prompts are tenant data
    assert args["swap_space"] == 0
    assert "max_loras" not in vsettings().async_engine_args()


@pytest.mark.parametrize("bad", [{"scheduling_policy": "lifo"},
                                 {"gpu_memory_utilization": 1.5}, {"max_num_seqs": 0}])
def test_bad_engine_settings_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        vsettings(**bad)


# -- request building --------------------------------------------------------------------------


def test_every_prompt_carries_the_tenants_salt() -> None:
    call = build(req())
    assert call.prompt == {"prompt_token_ids": IDS, "cache_salt": OWNER_SALT}
    assert call.request_id == "r1"
    with pytest.raises(EngineError, match="salt") as info:
        build(req(salt=""))
    assert info.value.retryable is False


def test_without_prefix_caching_there_is_no_cache_to_salt() -> None:
    assert "cache_salt" not in build(req(), enable_prefix_caching=False).prompt


def test_sampling_maps_field_by_field_and_max_tokens_fits_the_window() -> None:
    call = build(req(max_tokens=10_000, temperature=0.3, top_p=0.9, seed=5, stop=("END",),
                     stop_token_ids=(1,), ignore_eos=True))
    assert call.sampling == {
        "n": 1, "max_tokens": 4096 - len(IDS), "temperature": 0.3, "top_p": 0.9, "seed": 5,
        "stop": ["END"], "stop_token_ids": [1], "ignore_eos": True,
        "skip_special_tokens": True, "detokenize": True,
    }


@pytest.mark.parametrize(("ids", "why"), [([5] * 4096, "does not fit"), ([], "does not fit"),
                                          ([5, VOCAB], "outside the vocabulary")])
def test_prompts_that_cannot_run_are_final_errors(ids: list[int], why: str) -> None:
    with pytest.raises(EngineError, match=why) as info:
        build(req(ids=ids))
    assert info.value.retryable is False


def test_priority_is_passed_only_under_the_priority_policy() -> None:
    assert build(req(priority=-3), scheduling_policy="priority").priority == -3
    # FCFS orders by arrival whatever the priority says; 0 states that plainly.
    assert build(req(priority=-3), scheduling_policy="fcfs").priority == 0


def test_an_adapter_is_loaded_only_for_its_owner() -> None:
    own = build(req(adapter="support"), enable_lora=True)
    assert own.lora is not None
    assert own.lora["lora_name"] == "t7-support"
    assert own.lora["lora_path"] == "/loras/7/support"
    assert own.lora["lora_int_id"] > 0
    # Tenant 9 has an adapter of the same public name: it gets its own, never tenant 7's.
    theirs = build(req(adapter="support", salt="salt-of-9"), enable_lora=True)
    assert theirs.lora["lora_path"] == "/loras/9/support"
    assert theirs.lora["lora_int_id"] != own.lora["lora_int_id"]


def test_another_tenant_naming_an_adapter_gets_not_found_like_any_unknown_model() -> None:
    with pytest.raises(EngineError) as other:
        build(req(adapter="support", salt=OTHER_SALT), enable_lora=True)
    with pytest.raises(EngineError) as unknown:
        build(req(adapter="nonexistent", salt=OTHER_SALT), enable_lora=True)
    assert other.value.retryable is False
    assert str(other.value) == str(unknown.value).replace("nonexistent", "support")
    with pytest.raises(EngineError, match="does not exist"):
        build(req(adapter="support"), enable_lora=False)  # LoRA off: no adapter exists


def test_the_api_layer_resolves_adapters_per_tenant() -> None:
    from serving.adapters import AdapterNotFound

    assert CATALOG.resolve("support", 7).path == "/loras/7/support"
    assert CATALOG.visible_names(7) == ["support"]
    assert CATALOG.visible_names(8) == []
    with pytest.raises(AdapterNotFound):
        CATALOG.resolve("support", 8)


# -- the engine, against a fake AsyncLLM -------------------------------------------------------


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


@dataclass
class Output:
    prompt_token_ids: list[int]
    outputs: list[Completion]
    finished: bool
    num_cached_tokens: int | None = None


class EngineDeadError(RuntimeError):
    """Named as vLLM's, which is how the backend recognises it."""


@dataclass
class FakeAsyncLLM:
    """vLLM's contract: DELTA outputs; a cancelled or closed consumer aborts the request."""

    tokens: int = 5
    cached: int = 16
    delay: float = 0.0
    fail: BaseException | None = None
    # What vLLM's generate() raises when its own abort fails as it is cancelled (it wraps
    # any exception there in EngineGenerateError): instead of the CancelledError.
    abort_raises: BaseException | None = None
    vocab: int = VOCAB
    calls: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    shut: bool = False

    async def generate(self, prompt: Any, params: Any, request_id: str, *,
                       lora_request: Any = None, priority: int = 0) -> AsyncIterator[Output]:
        self.calls.append({"prompt": prompt, "params": params, "lora": lora_request,
                           "priority": priority, "request_id": request_id})
        try:
            for i in range(self.tokens):
                await asyncio.sleep(self.delay)
                if self.fail is not None and i == 2:
                    raise self.fail
                last = i == self.tokens - 1
                yield Output(prompt["prompt_token_ids"],
                             [Completion([100 + i], f"w{i} ", "length" if last else None)],
                             finished=last, num_cached_tokens=self.cached)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            if self.abort_raises is not None:
                raise self.abort_raises from None
            raise

    def get_tokenizer(self) -> list[int]:
        return list(range(self.vocab))  # anything with len()

    def shutdown(self) -> None:
        self.shut = True


def engine_with(fake: FakeAsyncLLM, catalog: AdapterCatalog = CATALOG, **kw: Any) -> VLLMEngine:
    return VLLMEngine(vsettings(tokenizer_path=SIM_DIR, **kw), catalog,
                      llm_factory=lambda settings, loggers: fake,
                      stat_factory=lambda sink: sink,
                      converter=lambda call: (call.prompt, call.sampling, call.lora),
                      lora_factory=lambda fields: fields)


def run(engine: VLLMEngine, scenario: Any) -> Any:
    async def main() -> Any:
        await engine.start()
        try:
            return await asyncio.wait_for(scenario(engine), 10)
        finally:
            await engine.stop()

    return asyncio.run(main())


def test_deltas_stream_and_usage_comes_from_vllms_outputs(tmp_path: Path) -> None:
    fake = FakeAsyncLLM(tokens=5, cached=16)

    async def scenario(e: VLLMEngine) -> list[Any]:
        return [d async for d in e.generate(req(adapter="support", priority=2))]

    deltas = run(engine_with(fake, adapter_dirs(tmp_path), enable_lora=True,
                             scheduling_policy="priority"), scenario)
    assert [d.token_ids for d in deltas] == [[100], [101], [102], [103], [104]]
    assert all(d.finish_reason is None for d in deltas[:-1])
    last = deltas[-1]
    assert last.finish_reason == FinishReason.LENGTH
    assert (last.usage.prompt_tokens, last.usage.cached_prompt_tokens,
            last.usage.output_tokens) == (len(IDS), 16, 5)
    call = fake.calls[0]
    assert call["prompt"]["cache_salt"] == OWNER_SALT and call["priority"] == 2
    assert call["lora"]["lora_name"] == "t7-support"
    assert fake.shut is True  # stop() shut the engine down


def test_abort_cancels_the_consumer_so_vllm_aborts_and_load_returns_to_idle() -> None:
    fake = FakeAsyncLLM(tokens=1000, delay=0.002)

    async def scenario(e: VLLMEngine) -> Any:
        got = []
        async for d in e.generate(req()):
            got.append(d)
            if len(got) == 3:
                assert e.load().running == 1
                await e.abort("r1")
                await e.abort("r1")
        return got, e.load()

    got, load = run(engine_with(fake), scenario)
    assert got[-1].finish_reason == FinishReason.ABORT
    assert got[-1].usage.output_tokens >= 3
    assert fake.aborted == ["r1"]
    assert load.running == 0


def test_an_abort_that_vllm_answers_with_an_error_is_still_the_abort() -> None:
    """A cancel (a client gone) is the abort however vLLM's generate() then ends: an error it
    raises while aborting (EngineGenerateError, a failed abort) must not turn it into a failed
    request (the worker would settle a hang-up as 'error')."""
    fake = FakeAsyncLLM(tokens=1000, delay=0.002,
                        abort_raises=RuntimeError("EngineGenerateError: abort failed"))

    async def scenario(e: VLLMEngine) -> Any:
        got = []
        async for d in e.generate(req()):
            got.append(d)
            if len(got) == 3:
                await e.abort("r1")
        return got, e.load()

    got, load = run(engine_with(fake), scenario)
    assert got[-1].finish_reason == FinishReason.ABORT
    assert got[-1].usage is not None and got[-1].usage.output_tokens >= 3
    assert fake.aborted == ["r1"] and load.running == 0


def test_closing_the_iterator_aborts_in_vllm() -> None:
    fake = FakeAsyncLLM(tokens=1000, delay=0.002)

    async def scenario(e: VLLMEngine) -> int:
        stream = e.generate(req())
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]
        for _ in range(100):
            if fake.aborted:
                break
            await asyncio.sleep(0.01)
        return e.load().running

    assert run(engine_with(fake), scenario) == 0
    assert fake.aborted == ["r1"]


@pytest.mark.parametrize(("error", "retryable"), [(ValueError("bad sampling"), False),
                                                  (EngineDeadError(), True),
                                                  (RuntimeError("cuda hiccup"), True)])
def test_vllm_failures_map_to_final_or_retryable(error: BaseException, retryable: bool) -> None:
    fake = FakeAsyncLLM(tokens=10, fail=error)

    async def scenario(e: VLLMEngine) -> None:
        async for _ in e.generate(req()):
            pass

    with pytest.raises(EngineError) as info:
        run(engine_with(fake), scenario)
    assert info.value.retryable is retryable
    assert info.value.usage is not None and info.value.usage.output_tokens == 2


def test_generate_error_wrapping_keeps_the_cause() -> None:
    class EngineGenerateError(Exception):
        pass

    try:
        raise EngineGenerateError() from ValueError("prompt too long")
    except EngineGenerateError as exc:
        assert map_error(exc, None).retryable is False


def test_a_tokenizer_other_than_the_gateways_refuses_to_start() -> None:
    engine = engine_with(FakeAsyncLLM(vocab=VOCAB + 1))
    with pytest.raises(EngineError, match="tokenizer"):
        asyncio.run(engine.start())


def test_load_reads_the_scheduler_stats() -> None:
    @dataclass
    class Stats:
        num_running_reqs: int = 3
        num_waiting_reqs: int = 2
        kv_cache_usage: float = 0.25

    @dataclass
    class CacheConfig:
        num_gpu_blocks: int = 1000
        block_size: int = 16

    @dataclass
    class Config:
        cache_config: CacheConfig = field(default_factory=CacheConfig)

    fake = FakeAsyncLLM()
    fake.vllm_config = Config()  # type: ignore[attr-defined]
    engine = engine_with(fake)
    sinks: list[LoadSink] = []
    engine._stat_factory = lambda sink: sinks.append(sink) or sink  # type: ignore[assignment]
    asyncio.run(engine.start())
    sinks[0].observe(Stats())
    engine._streams.update({f"r{i}": object() for i in range(5)})  # type: ignore[misc]
    load = engine.load()
    assert (load.running, load.waiting) == (3, 2)
    assert (load.kv_tokens_total, load.kv_tokens_used) == (16_000, 4_000)
    engine._streams.clear()
    assert engine.load().running == 0  # finished here, before the next step's stats say so


# -- the registry ------------------------------------------------------------------------------


def test_the_registry_builds_a_vllm_engine_from_the_pool_without_importing_vllm() -> None:
    spec = EngineSpec("gpu-a", "vllm", {"gpu_memory_utilization": 0.8,
                                         "scheduling_policy": "priority",
                                         "lora": {"enabled": True, "adapters": [
                                             {"name": "s", "tenant_id": 3, "path": "/l/3/s"}]}},
                      max_sequences=95, max_model_len=8192, tokenizer_path=SIM_DIR,
                      model_id="/models/llama-8b")
    engine = build_engine(spec)
    assert isinstance(engine, VLLMEngine)
    args = engine.settings.async_engine_args()
    assert args["model"] == "/models/llama-8b" and args["tokenizer"] == SIM_DIR
    assert (args["max_num_seqs"], args["max_model_len"]) == (95, 8192)
    assert args["enable_lora"] is True and args["scheduling_policy"] == "priority"
    assert len(engine.catalog) == 1


def test_the_chunked_prefill_limits_reach_vllm_and_the_simulated_engine_alike() -> None:
    # The same pool keys set the same limits in both backends (docs/adr/0017).
    limits = {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 80,
              "max_num_partial_prefills": 2, "prefill_tokens_per_s": 20_000.0}
    spec = EngineSpec("gpu-b", "vllm", dict(limits), max_sequences=8, max_model_len=32_768,
                      tokenizer_path=SIM_DIR, model_id="/models/llama-8b")
    vllm = build_engine(spec)
    args = vllm.settings.async_engine_args()
    assert {k: args[k] for k in limits if k != "prefill_tokens_per_s"} == {
        "max_num_batched_tokens": 512, "long_prefill_token_threshold": 80,
        "max_num_partial_prefills": 2}
    assert "prefill_tokens_per_s" not in args  # the dispatcher's figure, not vLLM's
    assert vllm.prefill_tokens_per_s == 20_000.0
    assert args["scheduling_policy"] == "priority"  # the default: the WFQ tag orders the batch
    sim = build_engine(EngineSpec("sim-b", "simulated", dict(limits), max_sequences=8,
                                  max_model_len=32_768, tokenizer_path=SIM_DIR))
    config = sim.config
    assert (config.step_tokens, config.chunk_cap(), config.max_num_partial_prefills) == (
        512, 80, 2)
    assert sim.prefill_tokens_per_s == 20_000.0


@pytest.mark.parametrize(("backend_settings", "message"), [
    ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ({"gpu_memory_utilization": True}, "wrong type"),
    ({"tensor_paralel_size": 2}, "unknown"),
    ({"lora": {"adapters": [{"name": "s", "tenant_id": 3, "path": "/l"}]}}, "lora.enabled"),
    ({"lora": {"enabled": True, "adapters": [{"name": "s", "tenant_id": 0, "path": "/l"}]}},
     "tenant_id"),
    ({"lora": {"enabled": True, "adapters": [{"name": "s", "tenant_id": 3, "path": "/l"},
                                             {"name": "s", "tenant_id": 3, "path": "/m"}]}},
     "two adapters"),
])
def test_the_registry_rejects_bad_vllm_settings(backend_settings: dict[str, Any],
                                                message: str) -> None:
    spec = EngineSpec("gpu-a", "vllm", backend_settings, tokenizer_path=SIM_DIR,
                      model_id="/models/x")
    with pytest.raises(EngineConfigError, match=message):
        build_engine(spec)


def test_the_registry_needs_a_model_path() -> None:
    with pytest.raises(EngineConfigError, match="model path"):
        build_engine(EngineSpec("gpu-a", "vllm", {}, tokenizer_path=SIM_DIR))


# -- vLLM's own classes, where vLLM imports ----------------------------------------------------


@needs_vllm
@pytest.mark.integration
def test_calls_become_vllms_own_prompt_sampling_and_lora_objects() -> None:
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VSamplingParams

    from workers.engine.vllm_backend import to_vllm

    call = build(req(adapter="support", max_tokens=7, temperature=0.5, seed=1),
                 enable_lora=True)
    prompt, params, lora = to_vllm(call)
    assert prompt["prompt_token_ids"] == IDS and prompt["cache_salt"] == OWNER_SALT
    assert isinstance(params, VSamplingParams)
    assert params.output_kind == RequestOutputKind.DELTA
    assert (params.max_tokens, params.temperature, params.seed, params.n) == (7, 0.5, 1, 1)
    assert isinstance(lora, LoRARequest)
    assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == (
        "t7-support", call.lora["lora_int_id"], "/loras/7/support")


@needs_vllm
@pytest.mark.integration
def test_engine_args_are_accepted_by_vllm() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = AsyncEngineArgs(**vsettings(enable_lora=True,
                                       scheduling_policy="priority").async_engine_args())
    assert args.scheduling_policy == "priority" and args.enable_lora is True


@needs_vllm
@pytest.mark.integration
def test_the_stat_logger_is_a_vllm_stat_logger_feeding_load() -> None:
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.stats import SchedulerStats

    from workers.engine.vllm_backend import stat_logger_factory

    sink = LoadSink()
    logger = stat_logger_factory(sink)(None, 0)
    assert isinstance(logger, StatLoggerBase)
    stats = SchedulerStats(num_running_reqs=4, num_waiting_reqs=1)
    logger.record(scheduler_stats=stats, iteration_stats=None)
    assert (sink.running, sink.waiting) == (4, 1)


# -- CPU hosts: the KV cache in bytes, never a fraction of host memory ------------------------


def _geometry(root: Path, vocab: int = VOCAB) -> str:
    """A model directory with only a config.json (2 layers x 2 KV heads x 32, bf16)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(
        '{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
        f'"hidden_size": 128, "head_dim": 32, "torch_dtype": "bfloat16", "vocab_size": {vocab}}}')
    return str(root)


def test_on_a_cpu_host_the_kv_cache_is_sized_in_bytes(tmp_path: Path) -> None:
    model = _geometry(tmp_path / "m")
    gpu = vsettings(model=model, gpu_memory_utilization=0.9).async_engine_args()
    assert gpu["gpu_memory_utilization"] == 0.9 and "kv_cache_memory_bytes" not in gpu
    # On a CPU vLLM reads the fraction as one of host memory and refuses to start when that
    # much is not free; it is not sent there, and the KV cache gets a size in bytes.
    explicit = vsettings(model=model, gpu_memory_utilization=0.9,
                         kv_cache_memory_bytes=64 << 20).async_engine_args(cpu=True)
    assert "gpu_memory_utilization" not in explicit
    assert explicit["kv_cache_memory_bytes"] == 64 << 20
    # Without a size: the pool's KV budget in tokens times the model's KV bytes per token.
    derived = vsettings(model=model, kv_cache_tokens=100_000).async_engine_args(cpu=True)
    assert derived["kv_cache_memory_bytes"] == 100_000 * (2 * 2 * 2 * 32 * 2)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        vsettings(model=str(tmp_path / "nowhere"), kv_cache_tokens=1000).async_engine_args(
            cpu=True)


def test_the_registry_passes_the_pools_kv_budget_and_byte_size(tmp_path: Path) -> None:
    spec = EngineSpec("cpu-a", "vllm", {"kv_cache_memory_bytes": 32 << 20},
                      kv_cache_tokens=5000, tokenizer_path=SIM_DIR,
                      model_id=_geometry(tmp_path / "m"))
    engine = build_engine(spec)
    assert isinstance(engine, VLLMEngine)
    assert engine.settings.kv_cache_tokens == 5000
    assert engine.settings.async_engine_args(cpu=True)["kv_cache_memory_bytes"] == 32 << 20
    with pytest.raises(EngineConfigError, match="kv_cache_memory_bytes"):
        build_engine(EngineSpec("cpu-a", "vllm", {"kv_cache_memory_bytes": 1000},
                                tokenizer_path=SIM_DIR, model_id="/m"))


# -- start-up checks and a dead engine, against the fake ---------------------------------------


@dataclass
class LoRAFake(FakeAsyncLLM):
    """add_lora as vLLM's: an adapter it cannot load is an error returned to that call."""

    bad_paths: tuple[str, ...] = ()
    added: list[str] = field(default_factory=list)

    async def add_lora(self, lora: dict[str, Any]) -> bool:
        if lora["lora_path"] in self.bad_paths:
            raise Exception("Call to add_lora method failed: Missing required configuration "
                            "fields: {'r'}")
        self.added.append(lora["lora_name"])
        return True


def test_adapters_vllm_cannot_load_fail_only_their_own_requests(tmp_path: Path) -> None:
    catalog = adapter_dirs(tmp_path)
    paths = {a.tenant_id: a.path for a in catalog}
    missing = AdapterCatalog([*catalog, Adapter("gone", 7, str(tmp_path / "7" / "gone"))],
                             salt_of=lambda t: f"salt-of-{t}")
    fake = LoRAFake(bad_paths=(paths[9],))

    async def scenario(e: VLLMEngine) -> dict[str, Any]:
        out: dict[str, Any] = {"broken": e.broken_adapters}
        for name, salt in (("support", "salt-of-9"), ("gone", OWNER_SALT), ("gone", OTHER_SALT)):
            with pytest.raises(EngineError) as info:
                [d async for d in e.generate(req(rid=name + salt, adapter=name, salt=salt))]
            out[(name, salt)] = info.value
        out["own"] = [d async for d in e.generate(req(rid="own", adapter="support"))][-1]
        out["failure"] = e.failure()
        return out

    out = run(engine_with(fake, missing, enable_lora=True), scenario)
    assert set(out["broken"]) == {"t9-support", "t7-gone"}
    assert "adapter_config.json" in out["broken"]["t7-gone"]
    assert fake.added == ["t7-support"]  # loaded once at start
    for owner in (("support", "salt-of-9"), ("gone", OWNER_SALT)):
        assert out[owner].retryable is False and "cannot be loaded" in str(out[owner])
    # Another tenant naming it learns nothing: "does not exist", as for any unknown model.
    assert "does not exist" in str(out[("gone", OTHER_SALT)])
    assert out["own"].finish_reason == FinishReason.LENGTH
    assert out["failure"] is None  # the engine lives


def test_an_adapter_removed_after_start_fails_its_request_before_reaching_vllm(
        tmp_path: Path) -> None:
    catalog = adapter_dirs(tmp_path)
    fake = LoRAFake()

    async def scenario(e: VLLMEngine) -> EngineError:
        (tmp_path / "7" / "support" / "adapter_config.json").unlink()
        with pytest.raises(EngineError) as info:
            [d async for d in e.generate(req(adapter="support"))]
        return info.value

    err = run(engine_with(fake, catalog, enable_lora=True), scenario)
    assert err.retryable is False and "cannot be loaded" in str(err)
    assert fake.calls == []  # never sent to vLLM, where it would kill the engine core


def test_a_dead_engine_core_is_reported_and_a_restart_clears_it() -> None:
    fake = FakeAsyncLLM(tokens=10, fail=EngineDeadError())
    engine = engine_with(fake)

    async def scenario(e: VLLMEngine) -> tuple[str | None, EngineError, bool]:
        assert e.failure() is None
        with pytest.raises(EngineError):
            [d async for d in e.generate(req())]
        dead = e.failure()
        with pytest.raises(EngineError) as refused:
            [d async for d in e.generate(req(rid="r2"))]
        fake.fail = None
        await e.stop()
        await e.start()
        return dead, refused.value, e.failure() is None

    dead, refused, healthy = run(engine, scenario)
    assert dead is not None and "died" in dead
    assert refused.retryable is True  # another worker can serve it
    assert healthy


def test_an_errored_asyncllm_is_a_failure_even_before_a_request_sees_it() -> None:
    fake = FakeAsyncLLM()
    engine = engine_with(fake)
    asyncio.run(engine.start())
    fake.errored = True  # type: ignore[attr-defined]  # vLLM's flag: engine core gone
    assert engine.failure() == "the vLLM engine core died"


def test_a_failed_start_check_shuts_the_engine_down() -> None:
    fake = FakeAsyncLLM(vocab=VOCAB + 1)
    with pytest.raises(EngineError, match="tokenizer"):
        asyncio.run(engine_with(fake).start())
    assert fake.shut is True  # no engine core process left behind


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_loading(
        tmp_path: Path) -> None:
    made: list[Any] = []
    engine = VLLMEngine(vsettings(model=_geometry(tmp_path / "m", vocab=VOCAB - 6),
                                  tokenizer_path=SIM_DIR),
                        llm_factory=lambda s, loggers: made.append(s) or FakeAsyncLLM())
    with pytest.raises(EngineError, match=f"only {VOCAB - 6}"):
        asyncio.run(engine.start())
    assert made == []  # refused from config.json, before any weights were loaded


# -- against the run's real vLLM engine --------------------------------------------------------

SALT_SECRET = "conformance-secret"  # as test_engine_conformance's adapter test


def real_req(rid: str, max_tokens: int = 400, salt: str = "x" * 32, **kw: Any) -> EngineRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=3, ignore_eos=True)
    return EngineRequest(rid, list(IDS), sp, cache_salt=salt, **kw)


@pytest.mark.integration
def test_load_comes_from_the_real_scheduler_stats(vllm_engine: Any) -> None:
    from tests.vllm_fixtures import KV_BYTES

    engine = vllm_engine.engine
    cache = engine._llm.vllm_config.cache_config

    async def scenario(e: VLLMEngine) -> tuple[Any, dict[str, Any], Any, dict[str, Any]]:
        started = {f"load{i}": asyncio.Event() for i in range(3)}

        async def consume(rid: str) -> None:
            async for d in e.generate(real_req(rid)):
                if d.token_ids:
                    started[rid].set()

        tasks = [asyncio.ensure_future(consume(rid)) for rid in started]
        await asyncio.gather(*(ev.wait() for ev in started.values()))
        await asyncio.sleep(0.2)  # a few more steps: their stats have arrived
        busy, busy_stats = e.load(), vllm_engine.scheduler()
        for rid in started:
            await e.abort(rid)
        await asyncio.gather(*tasks)
        for _ in range(100):  # the scheduler's own count, within a few steps of the abort
            if vllm_engine.scheduler()["running"] == 0:
                break
            await asyncio.sleep(0.05)
        return busy, busy_stats, e.load(), vllm_engine.scheduler()

    busy, busy_stats, idle, idle_stats = vllm_engine.run(scenario)
    assert busy_stats["running"] == 3 and busy.running == 3 and busy.waiting == 0
    assert busy.kv_tokens_used > 0 and busy.extra["kv_cache_usage"] > 0
    # The KV cache vLLM really allocated: 64 MiB at 512 bytes a token of the tiny model.
    assert busy.kv_tokens_total == cache.num_gpu_blocks * cache.block_size == KV_BYTES // 512
    assert idle_stats["running"] == 0 and idle.running == 0
    assert idle.kv_tokens_used == 0


@pytest.mark.integration
def test_on_this_cpu_the_engine_started_without_a_memory_fraction(vllm_engine: Any) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("a GPU host: vLLM sizes the KV cache from gpu_memory_utilization there")
    engine = vllm_engine.engine
    # The pool asks for 0.9 (a GPU setting): on the CPU it is not sent, the bytes are.
    assert engine.settings.gpu_memory_utilization == 0.9
    args = engine.settings.async_engine_args(cpu=True)
    assert "gpu_memory_utilization" not in args
    assert engine._llm.vllm_config.cache_config.kv_cache_memory_bytes == args[
        "kv_cache_memory_bytes"]


@pytest.mark.integration
def test_unloadable_adapters_fail_their_requests_and_the_real_engine_lives(
        vllm_engine: Any, settings: Any) -> None:
    from tenants.salts import cache_salt

    settings.CACHE_SALT_SECRET = SALT_SECRET
    owner, other = cache_salt(7), cache_salt(8)
    # The broken adapter failed vLLM's own add_lora at start; the missing one has no files.
    broken = vllm_engine.engine.broken_adapters
    assert set(broken) == {"t7-broken", "t7-gone"}
    assert "vLLM could not load it" in broken["t7-broken"]

    async def scenario(e: VLLMEngine) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, salt in (("broken", owner), ("gone", owner), ("broken", other)):
            with pytest.raises(EngineError) as info:
                [d async for d in e.generate(real_req(f"{name}-{salt[:4]}", 4, salt,
                                                      adapter=name))]
            out[(name, salt)] = info.value
        out["own"] = [d async for d in e.generate(real_req("own", 4, owner,
                                                           adapter="support"))][-1]
        out["plain"] = [d async for d in e.generate(real_req("plain", 4, other))][-1]
        out["failure"] = e.failure()
        return out

    out = vllm_engine.run(scenario)
    for name in ("broken", "gone"):
        err = out[(name, owner)]
        assert err.retryable is False and "cannot be loaded" in str(err)
    assert "does not exist" in str(out[("broken", other)])
    assert out["own"].finish_reason == out["plain"].finish_reason == FinishReason.LENGTH
    assert out["failure"] is None and not vllm_engine.engine._llm.errored


@pytest.mark.integration
def test_the_vocabulary_check_reads_vllms_own_tokenizer_and_model(
        vllm_engine: Any, tmp_path: Path) -> None:
    from tests.vllm_model import write_tiny_model

    bigger = write_tiny_model(tmp_path / "bigger", extra_tokens=4)
    probe = VLLMEngine(vsettings(model=str(vllm_engine.engine.settings.model),
                                 tokenizer_path=str(bigger)))
    probe._llm = vllm_engine.engine._llm  # the running engine, checked as at start

    async def scenario(_: VLLMEngine) -> tuple[EngineError, None]:
        with pytest.raises(EngineError) as info:
            await probe._check_tokenizer()
        return info.value, await vllm_engine.engine._check_tokenizer()

    err, same = vllm_engine.run(scenario)
    assert f"{VOCAB + 4} tokens" in str(err) and f"only {VOCAB}" in str(err)
    assert same is None  # the gateway's own tokenizer passes


def test_a_model_whose_tokenizer_overflows_its_embedding_never_starts(tmp_path: Path) -> None:
    if not HAS_VLLM:
        pytest.skip(MISSING)
    from tests.vllm_model import write_tiny_model

    model = write_tiny_model(tmp_path / "m", extra_tokens=4)  # the model's own files disagree
    engine = VLLMEngine(vsettings(model=str(model), max_model_len=512,
                                  kv_cache_memory_bytes=16 << 20))
    with pytest.raises(EngineError, match=f"only {VOCAB}"):
        asyncio.run(engine.start())
