"""The simulated pool the live inference tests share: its rows, its processes' settings and the
small client helpers (tests/test_inference_live.py and the live modules built on it).

Each module starts its own gateway and pool worker for this pool (``start``) with the settings it
tests; ``ready`` is what every test waits for before it runs: the transactional tests empty every
table and ``redis_client`` flushes Redis between tests while the processes keep running.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import openai

from catalog.models import Pool
from tests import procs, rkeys
from tests.factories import make_key, make_model, make_tenant

POOL = "live-pool"
# A pool whose only worker is wedged (heartbeats, never dispatches): requests wait until their
# TTFT deadline.
IDLE_POOL = "idle-pool"
IDLE_WORKER = "idle-wedged"
MODEL = "sim-live"
IDLE_MODEL = "sim-idle"
MAX_BYTES = 65_536
SERVER_ENV = {
    "SSE_KEEPALIVE_SECONDS": "0.3",
    "MAX_REQUEST_BYTES": str(MAX_BYTES),
    "WORKER_HEARTBEAT_SECONDS": "0.2",
    "WORKER_DEAD_AFTER_SECONDS": "2",
}
HELLO = [{"role": "user", "content": "Say hello."}]


def ensure_pools() -> None:
    # Transactional tests empty every table afterwards; the processes keep running, so each
    # test puts back the rows they serve.
    model = make_model(MODEL)
    Pool.objects.get_or_create(name=POOL, defaults={
        "model": model, "backend_settings": {"decode_tokens_per_s": 250.0},
        "max_sequences": 16})
    idle = make_model(IDLE_MODEL)
    Pool.objects.get_or_create(name=IDLE_POOL, defaults={"model": idle})


def start(live_system: Any, worker_id: str, env: Mapping[str, str] = SERVER_ENV) -> Any:
    """A gateway and one pool worker ``worker_id`` on ``POOL`` (``live_system``'s dict)."""
    return {**live_system(pool=POOL, worker_ids=[worker_id], env=env, prepare=ensure_pools),
            "worker_id": worker_id}


def ready(system: Any, redis_client: Any) -> Any:
    """Put the rows back and wait for the worker's next heartbeat (the flush removed it)."""
    ensure_pools()
    procs.wait_for_worker(redis_client, POOL, system["worker_id"], system["worker"], timeout=10)
    return system


def fixtures(worker_id: str, env: Mapping[str, str] = SERVER_ENV) -> tuple[Any, Any]:
    """A module's ``system`` (its processes, module-scoped) and ``live`` (``system`` once
    ready, per test) fixtures: ``system, live = live_pool.fixtures("my-w1", ENV)``."""
    import pytest

    @pytest.fixture(scope="module", name="system")
    def system_(live_system: Any) -> Any:
        return start(live_system, worker_id, env)

    @pytest.fixture(name="live")
    def live_(system: Any, redis_client: Any) -> Any:
        return ready(system, redis_client)

    return system_, live_


def sse_events(text: str) -> list[str]:
    """A streamed body's events with an id (``id: ...`` then ``data: ...``), as the spec reads
    them: comment lines (keep-alives, which end in no blank line of their own) dropped."""
    lines = "\n".join(line for line in text.split("\n") if not line.startswith(":"))
    return [e for e in lines.split("\n\n") if e.startswith("id: ")]


def tenant_key(**quota: Any) -> tuple[Any, str]:
    tenant = make_tenant(**quota)
    api_key, plain = make_key(tenant)
    return api_key, plain


def client(url: str, plain: str, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=plain, max_retries=0, **kw)


def rid_of(response_id: str) -> str:
    return response_id.split("-", 1)[1]


def listed_models(url: str, plain: str) -> set[str]:
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {plain}"}, timeout=10)
    return {m["id"] for m in r.json().get("data", [])} if r.status_code == 200 else set()


def counters(redis_client: Any, api_key: Any) -> dict[str, int]:
    tenant = api_key.tenant_id
    names = {"conc_t": rkeys.counter_key("conc", tenant),
             "conc_k": rkeys.counter_key("conc", tenant, "key", api_key.pk),
             "streams_t": rkeys.counter_key("streams", tenant),
             "streams_k": rkeys.counter_key("streams", tenant, "key", api_key.pk)}
    return {n: int(redis_client.get(k) or 0) for n, k in names.items()}
