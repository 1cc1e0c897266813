"""The design's noisy-neighbour table, through the real dispatcher and the simulated engine.

Same workload as ``gateway.py`` in the design: a pool of 2,000 tokens/s, at most 500 per
sequence; three small tenants each send one 300-token request per second for 60 s; from t=5
to t=25 a noisy tenant sends three 2,000-token requests per second (three times capacity).
Four configurations: FIFO or WFQ, with or without a per-tenant budget of 1,000 tokens/s (burst
8,000) charged at admission.

Unlike the design's tick simulation, every request here goes through the production code:
``serving.admission.admit`` (the token buckets, on Redis), ``serving.wfq`` (per-tenant queues
and the dispatcher, on Redis) and ``SimulatedEngine`` (continuous batching, paged KV cache),
on a virtual clock so 60 s of traffic takes a few seconds. The dispatcher loop passes its
per-tenant running counts, as ``EngineHost`` does, so WFQ keeps each active tenant's share of
the slots (slot fairness, docs/adr/0006; ``WFQ_SLOT_RESERVE=0`` shows the behaviour without
it). A request's tokens are a short prompt plus ``cost - prompt`` output tokens
(``ignore_eos``), so its cost matches the design.

Latency is completion time minus arrival, in seconds (the design counts whole 1 s ticks, so its
"1" means "within the second it arrived"); TTFT is the first output token minus arrival.

    python bench/noisy_neighbour.py [--seqs 4] [--plot noisy.png]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gateway.settings")
os.environ.setdefault("REDIS_KEY_PREFIX", f"bench-nn-{os.getpid()}")

import django

django.setup()

from serving import admission, settlement  # noqa: E402
from serving.admission import AdmissionLimits, Rejected, ScopeLimits  # noqa: E402
from serving.wfq import DispatchedItem, Prices, Wfq  # noqa: E402
from workers.engine.base import EngineRequest, SamplingParams  # noqa: E402
from workers.engine.clock import VirtualClock  # noqa: E402
from workers.engine.simulated import SimConfig, SimulatedEngine  # noqa: E402

CAPACITY = 2000  # tokens per second for the whole pool
PER_SEQ = 500  # tokens per second for one sequence
SMALL = ("t1", "t2", "t3")
PROMPT = "Tell me about fair queueing."


def workload() -> list[tuple[int, str, int]]:
    """(arrival second, tenant, cost in tokens), exactly as the design's ``workload()``."""
    reqs = []
    for t in range(60):
        reqs += [(t, name, 300) for name in SMALL]
        if 5 <= t < 25:
            reqs += [(t, "noisy", 2000) for _ in range(3)]
    return reqs


@dataclass
class Outcome:
    tenant: str
    arrival: float
    cost: int
    first: float = -1.0
    done: float = -1.0


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=lambda: {"noisy": 0, "small": 0})


def budget_limits() -> AdmissionLimits:
    # 1,000 tokens/s with a burst of 8,000, as the design's Budget(1000, 8000). The whole cost is
    # charged to the output bucket; the prompt's few tokens go to an unlimited input bucket.
    return AdmissionLimits(tenant=ScopeLimits(output_tpm=60_000, output_burst=8_000))


async def scenario(clock: VirtualClock, policy: str, budget: bool, seqs: int) -> Run:
    cfg = SimConfig(
        max_running_seqs=seqs, decode_tokens_per_s=PER_SEQ, pool_tokens_per_s=CAPACITY,
        kv_cache_tokens=381_000, seed=7,
    )
    engine = SimulatedEngine(cfg, clock=clock)
    await engine.start()
    prompt_ids = engine.tokenizer.encode(PROMPT)
    n_prompt = len(prompt_ids)
    wfq = Wfq(policy=policy, prices=Prices(1.0, 1.0))  # cost = tokens, as in the design
    pool = f"nn-{policy}-{int(budget)}-{uuid.uuid4().hex[:6]}"
    run, live = Run(), {}
    wake = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()  # strong references to the serving tasks
    in_service = 0
    running: Counter[str] = Counter()  # this worker's sequences per tenant, as EngineHost keeps
    arrivals_done = False

    def admit(rid: str, tenant: str, cost: int, now: float) -> bool:
        if not budget:
            return True
        verdict = admission.admit(  # tenant ids are per run: no bucket carries over
            request_id=rid, tenant_id=f"{pool}.{tenant}", key_id=None, pool=pool, model="sim",
            prompt_tokens=n_prompt, max_output_tokens=cost, stream=False,
            limits=budget_limits(), now=now,
        )
        if isinstance(verdict, Rejected):
            run.rejected["noisy" if tenant == "noisy" else "small"] += 1
            return False
        return True

    async def arrivals() -> None:
        nonlocal arrivals_done
        for second, tenant, cost in workload():
            if second > clock.now():
                await asyncio.sleep(second - clock.now())
            rid = uuid.uuid4().hex
            if not admit(rid, tenant, cost, clock.now()):
                continue
            live[rid] = Outcome(tenant, clock.now(), cost)
            wfq.enqueue(pool, tenant, rid, weight=1.0, prompt_tokens=n_prompt,
                        max_output_tokens=cost - n_prompt, kv_tokens=cost, now=clock.now())
            wake.set()
        arrivals_done = True
        wake.set()

    async def serve(item: DispatchedItem) -> None:
        nonlocal in_service
        out = live[item.request_id]
        request = EngineRequest(
            request_id=item.request_id, prompt_token_ids=prompt_ids,
            sampling=SamplingParams(max_tokens=out.cost - n_prompt, ignore_eos=True),
            cache_salt=item.tenant_id,
        )
        async for delta in engine.generate(request):
            if out.first < 0 and delta.token_ids:
                out.first = clock.now()
        out.done = clock.now()
        run.outcomes.append(out)
        wfq.complete(pool, item.tenant_id, estimated_cost=item.cost, actual_cost=item.cost,
                     weight=item.weight, request_id=item.request_id, worker_id="bench")
        if budget:
            settlement.settle(item.request_id, status="ok", finish_reason="length",
                              output_tokens=out.cost, now=clock.now(), wfq_correction=False)
        in_service -= 1  # before waking the dispatcher, so it sees the pool drained
        running[item.tenant_id] -= 1
        wake.set()

    async def dispatcher() -> None:
        nonlocal in_service
        # A worker's loop: take work only into free slots, smallest tag first (docs/adr/0001),
        # passing its per-tenant running counts for slot fairness (docs/adr/0006).
        while not (arrivals_done and not in_service and not wfq.backlog(pool)):
            wake.clear()
            load = engine.load()
            # Count what this loop handed out, not what the engine has picked up yet: a serving
            # task submits to the engine only when it first runs.
            free = load.max_running - in_service
            items = []
            if free > 0:
                items = wfq.dispatch_many(
                    pool, n=free, free_slots=free,
                    free_kv_tokens=load.kv_tokens_total - load.kv_tokens_used, worker_id="bench",
                    running=running, now=clock.now(),
                )
            for item in items:
                in_service += 1
                running[item.tenant_id] += 1
                task = asyncio.create_task(serve(item))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if not items:
                await wake.wait()

    await asyncio.gather(arrivals(), dispatcher())
    await engine.stop()
    wfq.reset(pool)
    return run


def percentiles(xs: list[float]) -> tuple[float, float, float]:
    if not xs:
        return (0.0, 0.0, 0.0)
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731 - same rule as the design
    return pick(0.5), pick(0.95), xs[-1]


CONFIGS = [
    ("FIFO, no budget", "fifo", False),
    ("FIFO, budget 1,000 tok/s", "fifo", True),
    ("WFQ, no budget", "wfq", False),
    ("WFQ, budget 1,000 tok/s", "wfq", True),
]


def fmt(p: tuple[float, float, float]) -> str:
    return " / ".join(f"{x:.1f}" for x in p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=8,
                        help="running sequences per engine: a request holds its slot to the end,"
                             " so fewer slots mean longer waits behind long requests")
    parser.add_argument("--plot", help="write a PNG of small-tenant p95 latency and TTFT")
    args = parser.parse_args()
    print(f"pool: {CAPACITY} tok/s, {PER_SEQ} tok/s per sequence, {args.seqs} running sequences;"
          " small tenants offer 900 tok/s,\nnoisy offers 6,000 tok/s for 20 s."
          " Seconds, p50 / p95 / max, through Redis + the simulated engine.\n")
    head = (f"{'configuration':<26}{'small latency':>20}{'small TTFT':>20}{'noisy latency':>22}"
            f"{'noisy 429s':>12}{'noisy tok':>11}{'wall s':>8}")
    print(head)
    rows = []
    for label, policy, budget in CONFIGS:
        began = time.perf_counter()
        run = _run(policy, budget, args.seqs)
        wall = time.perf_counter() - began
        small = [o for o in run.outcomes if o.tenant != "noisy"]
        noisy = [o for o in run.outcomes if o.tenant == "noisy"]
        lat_s = percentiles([o.done - o.arrival for o in small])
        ttft_s = percentiles([o.first - o.arrival for o in small])
        lat_n = percentiles([o.done - o.arrival for o in noisy])
        served = sum(o.cost for o in noisy)
        rows.append((label, lat_s, ttft_s))
        print(f"{label:<26}{fmt(lat_s):>20}{fmt(ttft_s):>20}{fmt(lat_n):>22}"
              f"{run.rejected['noisy']:>12}{served:>11,}{wall:>8.1f}")
    print("\nDesign (1 s ticks):  FIFO 36/48/49, FIFO+budget 1/3/3, WFQ 1/1/1, WFQ+budget 1/1/1"
          " (small tenants); noisy 429s 47 with a budget.")
    if args.plot:
        plot(rows, args.plot)


def _run(policy: str, budget: bool, seqs: int) -> Run:
    clock = VirtualClock()
    return clock.run(scenario(clock, policy, budget, seqs))


def plot(rows: list[tuple[str, tuple, tuple]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'); no plot drawn")
        return
    labels = [r[0] for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([x - 0.2 for x in xs], [r[1][1] for r in rows], width=0.4, label="latency p95")
    ax.bar([x + 0.2 for x in xs], [r[2][1] for r in rows], width=0.4, label="TTFT p95")
    ax.axhline(2.0, color="gray", linestyle="--", linewidth=1, label="2 s TTFT promise (I3)")
    ax.set_xticks(list(xs), labels, rotation=15)
    ax.set_ylabel("seconds")
    ax.set_title("Small tenants while a noisy tenant floods at 3x capacity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
