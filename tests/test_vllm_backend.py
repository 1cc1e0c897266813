"""The vLLM backend: request building (salt, adapters, priority), streaming, abort, load.

vLLM cannot be installed on these machines (its wheel is a CUDA build pinning torch), so:
- the pure translation ``EngineRequest -> generate() arguments`` is tested as data;
- the engine's streaming, abort, error and load handling run against a fake ``AsyncLLM`` that
  keeps vLLM's documented contract (DELTA outputs; cancelling the consumer aborts) - a unit
  test of this one module;
- the tests that build vLLM's own classes (``TokensPrompt``, ``SamplingParams``,
  ``LoRARequest``, ``AsyncEngineArgs``, ``StatLoggerBase``) run where vLLM imports and are
  skipped here, saying so.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from workers.engine.adapters import Adapter, AdapterCatalog
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
from workers.tokenization import load_tokenizer, sim_model_dir

TOK = load_tokenizer()
VOCAB = TOK.vocab_size
IDS = TOK.encode("Adapters are tenant data; prefix caches are scoped per tenant.")
SIM_DIR = str(sim_model_dir())
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vLLM is not installed (CUDA-only wheel): vLLM's own classes untested")

OWNER_SALT, OTHER_SALT = "salt-of-7", "salt-of-8"
CATALOG = AdapterCatalog([Adapter("support", 7, "/loras/7/support"),
                          Adapter("support", 9, "/loras/9/support")],
                         salt_of=lambda t: f"salt-of-{t}")


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
    # vLLM rejects a non-zero priority under FCFS, so the WFQ order is not sent there.
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
    from workers.engine.adapters import AdapterNotFound

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
            raise

    def get_tokenizer(self) -> list[int]:
        return list(range(self.vocab))  # anything with len()

    def shutdown(self) -> None:
        self.shut = True


def engine_with(fake: FakeAsyncLLM, **kw: Any) -> VLLMEngine:
    return VLLMEngine(vsettings(tokenizer_path=SIM_DIR, **kw), CATALOG,
                      llm_factory=lambda settings, loggers: fake,
                      stat_factory=lambda sink: sink,
                      converter=lambda call: (call.prompt, call.sampling, call.lora))


def run(engine: VLLMEngine, scenario: Any) -> Any:
    async def main() -> Any:
        await engine.start()
        try:
            return await asyncio.wait_for(scenario(engine), 10)
        finally:
            await engine.stop()

    return asyncio.run(main())


def test_deltas_stream_and_usage_comes_from_vllms_outputs() -> None:
    fake = FakeAsyncLLM(tokens=5, cached=16)

    async def scenario(e: VLLMEngine) -> list[Any]:
        return [d async for d in e.generate(req(adapter="support", priority=2))]

    deltas = run(engine_with(fake, enable_lora=True, scheduling_policy="priority"), scenario)
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
def test_engine_args_are_accepted_by_vllm() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = AsyncEngineArgs(**vsettings(enable_lora=True,
                                       scheduling_policy="priority").async_engine_args())
    assert args.scheduling_policy == "priority" and args.enable_lora is True


@needs_vllm
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
