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

``--flood`` runs the long-prompt case of issue 16 instead (docs/adr/0017): the same pool with a
32k context, prefill at 10x the decode rate (20,000 tok/s, as measured engines do), vLLM's
chunked-prefill limits; the small tenants as above, and from t=5 to t=25 a fourth tenant
sending distinct prompts of ``--prompt`` tokens (24,000) with 50 output tokens at ``--times``
(3) times the pool's prefill capacity. Rows: FIFO; WFQ with slot shares only (ADR 0006, the
engine FCFS inside, no per-request chunk cap); WFQ with engine shares (rule E: prefill and KV
shares, the WFQ tag as the engine's priority, ``long_prefill_token_threshold``), with and
without the budget; and the flooder alone (work-conserving: all of the prefill capacity).
"flood prefill" is the flooder's prompt tokens served per second between its first arrival and
its last completion, against the pool's 20,000.

    python bench/noisy_neighbour.py [--seqs 4] [--plot noisy.png]
    python bench/noisy_neighbour.py --flood [--prompt 24000] [--times 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
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

from django.conf import settings  # noqa: E402

from serving import admission, settlement  # noqa: E402
from serving.admission import AdmissionLimits, Rejected, ScopeLimits  # noqa: E402
from serving.wfq import DispatchedItem, EngineShares, Prices, Wfq  # noqa: E402
from workers.engine.base import EngineRequest, SamplingParams  # noqa: E402
from workers.engine.clock import VirtualClock  # noqa: E402
from workers.engine.simulated import SimConfig, SimulatedEngine  # noqa: E402

CAPACITY = 2000  # tokens per second for the whole pool
PER_SEQ = 500  # tokens per second for one sequence
SMALL = ("t1", "t2", "t3")
PROMPT = "Tell me about fair queueing."


PREFILL = 20_000  # prompt tokens per second: 10x the decode rate (docs/adr/0017)
CONTEXT = 32_768


@dataclass(frozen=True)
class Case:
    """A workload and what the dispatcher and engine do about it."""

    flood_prompt: int = 0  # 0: the design's workload; else the long-prompt flood's prompt length
    flood_times: float = 3.0  # the flood's prompt tokens/s as a multiple of PREFILL
    engine_shares: bool = False  # rule E, the tag as engine priority, a per-request chunk cap
    small: bool = True  # False: the flooder alone
    batched: int = 512  # the engine's max_num_batched_tokens
    chunk_cap: bool = True  # with engine shares: the default long_prefill_token_threshold
    rule_e: bool = True  # with engine shares: the dispatcher's prefill and KV shares


def workload(case: Case = Case()) -> list[tuple[float, str, int, int]]:
    """(arrival second, tenant, prompt tokens (0 = the short prompt), output tokens).

    The design's ``workload()`` by default: 300-token requests, the noisy one's of 2,000."""
    reqs: list[tuple[float, str, int, int]] = []
    for t in range(60):
        if case.small:
            reqs += [(t, name, 0, 300) for name in SMALL]
        if 5 <= t < 25 and not case.flood_prompt:
            reqs += [(t, "noisy", 0, 2000) for _ in range(3)]
    if case.flood_prompt:
        gap = case.flood_prompt / (case.flood_times * PREFILL)
        k = 0
        while 5 + k * gap < 25:
            reqs.append((5 + k * gap, "noisy", case.flood_prompt, 50))
            k += 1
    return sorted(reqs, key=lambda r: r[0])


@dataclass
class Outcome:
    tenant: str
    arrival: float
    cost: int
    prompt: int = 0
    charged: int = 0  # output tokens charged at admission (the budget's bucket)
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


def engine_config(seqs: int, case: Case) -> SimConfig:
    if not case.flood_prompt:
        return SimConfig(max_running_seqs=seqs, decode_tokens_per_s=PER_SEQ,
                         pool_tokens_per_s=CAPACITY, kv_cache_tokens=381_000, seed=7)
    # vLLM's chunked prefill: max_num_batched_tokens a step; with engine shares at most the
    # default long_prefill_token_threshold of one prompt a step (80: one decode step's worth),
    # so a short prompt beside a long one is prefilled in the same step and a step stays short.
    return SimConfig(max_running_seqs=seqs, decode_tokens_per_s=PER_SEQ,
                     pool_tokens_per_s=CAPACITY, prefill_tokens_per_s=PREFILL,
                     kv_cache_tokens=381_000, max_model_len=CONTEXT, seed=7,
                     max_num_batched_tokens=case.batched,
                     long_prefill_token_threshold=(None if case.engine_shares and case.chunk_cap
                                                   else 0))


async def scenario(clock: VirtualClock, policy: str, budget: bool, seqs: int,
                   case: Case = Case()) -> Run:
    cfg = engine_config(seqs, case)
    engine = SimulatedEngine(cfg, clock=clock)
    await engine.start()
    prompt_ids = engine.tokenizer.encode(PROMPT)
    n_prompt = len(prompt_ids)
    rng = random.Random(11)
    vocab = engine.tokenizer.vocab_size
    # Cost = tokens, as in the design; with engine shares the default prices (docs/adr/0017).
    prices = Prices.from_settings() if case.engine_shares else Prices(1.0, 1.0)
    wfq = Wfq(policy=policy, prices=prices)
    pool = f"nn-{policy}-{int(budget)}-{uuid.uuid4().hex[:6]}"
    run, live = Run(), {}
    wake = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()  # strong references to the serving tasks
    in_service = 0
    running: Counter[str] = Counter()  # this worker's sequences per tenant, as EngineHost keeps
    pending: Counter[str] = Counter()  # prompt tokens not yet prefilled, per tenant (rule E)
    held: Counter[str] = Counter()  # KV tokens reserved, per tenant (rule E)
    prompts: dict[str, list[int]] = {}
    arrivals_done = False

    async def admit(rid: str, tenant: str, charged: int, now: float, prompt: int,
                    max_out: int) -> bool:
        """Charge and queue (the gateway's admission when a budget is set), or just queue."""
        if not budget:
            wfq.enqueue(pool, tenant, rid, weight=1.0, prompt_tokens=prompt,
                        max_output_tokens=max_out, kv_tokens=prompt + max_out, now=now)
            return True
        verdict = await admission.admit_async(  # tenant ids are per run: no bucket carries over
            request_id=rid, tenant_id=f"{pool}.{tenant}", key_id=None, pool=pool, model="sim",
            prompt_tokens=n_prompt, max_output_tokens=charged, stream=False,
            limits=budget_limits(), now=now,
            queueing=admission.Queueing(weight=1.0, kv_tokens=prompt + max_out, policy=policy,
                                        prices=prices, sizes=(prompt, max_out)),
        )
        if isinstance(verdict, Rejected):
            run.rejected["noisy" if tenant == "noisy" else "small"] += 1
            return False
        return True

    async def arrivals() -> None:
        nonlocal arrivals_done
        for second, tenant, prompt, out_tokens in workload(case):
            if second > clock.now():
                await asyncio.sleep(second - clock.now())
            rid = uuid.uuid4().hex
            # A long prompt is distinct per request, so no prefix cache hides its prefill.
            ids = [rng.randrange(10, vocab) for _ in range(prompt)] if prompt else prompt_ids
            max_out = out_tokens if prompt else out_tokens - n_prompt
            cost = len(ids) + max_out
            charged = max_out + len(ids) * (not prompt)  # the design charges its whole cost
            prompts[rid] = ids
            live[rid] = Outcome(tenant, clock.now(), cost, len(ids), charged)
            if not await admit(rid, tenant, charged, clock.now(), len(ids), max_out):
                del prompts[rid], live[rid]
                continue
            wake.set()
        arrivals_done = True
        wake.set()

    async def serve(item: DispatchedItem) -> None:
        nonlocal in_service
        out = live[item.request_id]
        ids = prompts.pop(item.request_id)
        request = EngineRequest(
            request_id=item.request_id, prompt_token_ids=ids,
            sampling=SamplingParams(max_tokens=out.cost - len(ids), ignore_eos=True),
            cache_salt=item.tenant_id,
            # As EngineHost: the WFQ tag orders prefill and admission inside the engine.
            priority=int(item.tag) if case.engine_shares else 0,
        )
        pending[item.tenant_id] += len(ids) - item.kv_tokens  # the real prompt, now known
        async for delta in engine.generate(request):
            if out.first < 0 and delta.token_ids:
                out.first = clock.now()
                pending[item.tenant_id] -= len(ids)
                wake.set()  # its prefill share is free again
        out.done = clock.now()
        run.outcomes.append(out)
        held[item.tenant_id] -= item.kv_tokens
        wfq.complete(pool, item.tenant_id, estimated_cost=item.cost, actual_cost=item.cost,
                     weight=item.weight, request_id=item.request_id, worker_id="bench")
        if budget:
            settlement.settle(pool, item.request_id, status="ok", finish_reason="length",
                              output_tokens=out.charged, now=clock.now(), wfq_correction=False)
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
            shares = None
            if case.engine_shares and case.rule_e:
                shares = EngineShares(PREFILL * settings.WFQ_PREFILL_HORIZON_SECONDS,
                                      float(load.kv_tokens_total), pending, held)
            if free > 0:
                items = wfq.dispatch_many(
                    pool, n=free, free_slots=free,
                    free_kv_tokens=load.kv_tokens_total - load.kv_tokens_used, worker_id="bench",
                    running=running, now=clock.now(), engine=shares,
                )
            for item in items:
                in_service += 1
                running[item.tenant_id] += 1
                pending[item.tenant_id] += item.kv_tokens  # until the prompt is known
                held[item.tenant_id] += item.kv_tokens
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


def fmt(p: tuple[float, float, float], digits: int = 1) -> str:
    return " / ".join(f"{x:.{digits}f}" for x in p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=8,
                        help="running sequences per engine: a request holds its slot to the end,"
                             " so fewer slots mean longer waits behind long requests")
    parser.add_argument("--plot", help="write a PNG of small-tenant p95 latency and TTFT")
    parser.add_argument("--flood", action="store_true",
                        help="the long-prompt flood of issue 16 instead of the design's table")
    parser.add_argument("--prompt", type=int, default=24_000, help="flood prompt length")
    parser.add_argument("--times", type=float, default=3.0,
                        help="flood prompt tokens/s as a multiple of the prefill capacity")
    parser.add_argument("--batched", type=int, default=512,
                        help="the engine's max_num_batched_tokens in the flood case")
    args = parser.parse_args()
    if args.flood:
        flood_main(args.seqs, args.prompt, args.times, args.batched)
        return
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


def _run(policy: str, budget: bool, seqs: int, case: Case = Case()) -> Run:
    clock = VirtualClock()
    return clock.run(scenario(clock, policy, budget, seqs, case))


def flood_configs(prompt: int, times: float, batched: int) -> list[tuple[str, str, bool, Case]]:
    shares = Case(prompt, times, engine_shares=True, batched=batched)
    plain = Case(prompt, times, batched=batched)
    return [
        ("FIFO, no budget", "fifo", False, plain),
        ("WFQ slot shares, no budget", "wfq", False, plain),
        ("WFQ engine shares, no budget", "wfq", False, shares),
        ("WFQ engine shares, budget", "wfq", True, shares),
        ("flooder alone, engine shares", "wfq", False,
         Case(prompt, times, engine_shares=True, small=False, batched=batched)),
        ("engine shares, no chunk cap", "wfq", False,
         Case(prompt, times, engine_shares=True, batched=batched, chunk_cap=False)),
        ("engine shares, no rule E", "wfq", False,
         Case(prompt, times, engine_shares=True, batched=batched, rule_e=False)),
    ]


def flood_main(seqs: int, prompt: int, times: float, batched: int) -> None:
    threshold = engine_config(seqs, Case(1, engine_shares=True)).chunk_cap()
    print(f"pool: {CAPACITY} tok/s decode, {PER_SEQ} per sequence, {PREFILL} tok/s prefill, "
          f"{seqs} sequences, {CONTEXT} context, max_num_batched_tokens {batched} (with engine"
          f" shares long_prefill_token_threshold {threshold});\n"
          "small tenants 3 x 1 req/s of 300 tokens; "
          f"flooder: prompts of {prompt} tokens + 50 output at {times:g}x the prefill capacity,"
          " t=5-25 s. Seconds, p50 / p95 / max.\n")
    print(f"{'configuration':<33}{'small TTFT':>20}{'small latency':>20}{'flood TTFT':>20}"
          f"{'flood prefill tok/s':>21}{'share':>7}{'429s':>6}{'wall s':>8}")
    for label, policy, budget, case in flood_configs(prompt, times, batched):
        began = time.perf_counter()
        run = _run(policy, budget, seqs, case)
        wall = time.perf_counter() - began
        small = [o for o in run.outcomes if o.tenant != "noisy"]
        noisy = [o for o in run.outcomes if o.tenant == "noisy"]
        ttft_s = percentiles([o.first - o.arrival for o in small])
        lat_s = percentiles([o.done - o.arrival for o in small])
        ttft_n = percentiles([o.first - o.arrival for o in noisy])
        rate = 0.0
        if noisy:
            span = max(o.first for o in noisy) - min(o.arrival for o in noisy)
            rate = sum(o.prompt for o in noisy) / span if span > 0 else 0.0
        print(f"{label:<33}{fmt(ttft_s, 2) if small else '-':>20}{fmt(lat_s) if small else '-':>20}"
              f"{fmt(ttft_n):>20}{rate:>21,.0f}{rate / PREFILL:>7.2f}"
              f"{run.rejected['noisy']:>6}{wall:>8.1f}")
    print("\nTargets (issue 16): small TTFT p95 < 2 s with and without a budget; the flooder"
          " keeps at least its\nweighted share of the prefill capacity (1/4 here) while the"
          " others are active, and all of it alone.")


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
