"""How fast the simulated engine simulates: tokens of virtual time per second of wall/CPU time.

Runs N requests through ``SimulatedEngine`` on the virtual clock, through the real
``generate()`` interface (one consumer task per request, one delta per step per sequence), for a
few batch sizes, and prints a table. Single-threaded, so tokens per CPU-second is the figure
per core. Target: at least 100,000 simulated tokens per second per core.

    .venv/bin/python bench/sim_engine_speed.py [--requests 2000] [--repeat 3] [--plot out.png]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving.tokenization import load_tokenizer
from workers.engine.base import EngineRequest, SamplingParams
from workers.engine.clock import VirtualClock
from workers.engine.simulated import CORPUS, SimConfig, SimulatedEngine

TARGET = 100_000


@dataclass
class Result:
    batch: int
    requests: int
    prompt_tokens: int
    output_tokens: int
    virtual_s: float
    wall_s: float
    cpu_s: float
    preemptions: int

    @property
    def out_per_cpu_s(self) -> float:
        return self.output_tokens / self.cpu_s

    @property
    def out_per_wall_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def all_per_cpu_s(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.cpu_s


def workload(n: int, seed: int) -> list[EngineRequest]:
    """Chat prompts cut from the corpus (50-600 tokens), 20-400 output tokens, some shared."""
    tok = load_tokenizer(None)
    corpus = tok.encode(CORPUS.read_text(encoding="utf-8"))
    rng = random.Random(seed)
    system = tok.apply_chat_template([{"role": "system", "content": "Answer briefly."}], False)
    reqs = []
    for i in range(n):
        length = rng.randint(50, 600)
        start = rng.randrange(len(corpus) - length)
        prompt = system + corpus[start : start + length]
        sampling = SamplingParams(max_tokens=rng.randint(20, 400), seed=i, ignore_eos=i % 2 == 0)
        reqs.append(EngineRequest(f"r{i}", prompt, sampling, cache_salt=f"t{i % 20}"))
    return reqs


async def closed_loop(engine: SimulatedEngine, reqs: list[EngineRequest], clients: int) -> int:
    """``clients`` concurrent clients, each sending its next request when the last one ends."""
    pending = iter(reqs)
    produced = 0

    async def client() -> None:
        nonlocal produced
        for request in pending:
            async for delta in engine.generate(request):
                produced += len(delta.token_ids)

    await asyncio.gather(*(client() for _ in range(clients)))
    return produced


def run_once(batch: int, reqs: list[EngineRequest]) -> Result:
    clock = VirtualClock()
    config = SimConfig(max_running_seqs=batch)  # design pool: 2,000 tok/s, 500 per sequence

    async def main() -> tuple[int, SimulatedEngine]:
        engine = SimulatedEngine(config, clock=clock)
        await engine.start()
        produced = await closed_loop(engine, reqs, clients=batch)
        await engine.stop()
        return produced, engine

    wall, cpu = time.perf_counter(), time.process_time()
    produced, engine = clock.run(main())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return Result(
        batch=batch,
        requests=len(reqs),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in reqs),
        output_tokens=produced,
        virtual_s=clock.now(),
        wall_s=wall,
        cpu_s=cpu,
        preemptions=engine.stats["preemptions"],
    )


def median_run(batch: int, reqs: list[EngineRequest], repeat: int) -> Result:
    runs = sorted((run_once(batch, reqs) for _ in range(repeat)), key=lambda r: r.cpu_s)
    return runs[len(runs) // 2]


def print_table(results: list[Result]) -> None:
    head = (
        f"{'batch':>6}{'requests':>9}{'out tok':>10}{'virtual s':>11}{'wall s':>8}{'cpu s':>7}"
        f"{'out tok/cpu-s':>15}{'out tok/wall-s':>16}{'all tok/cpu-s':>15}{'speedup':>9}"
    )
    print(head)
    for r in results:
        print(
            f"{r.batch:>6}{r.requests:>9}{r.output_tokens:>10,}{r.virtual_s:>11.1f}"
            f"{r.wall_s:>8.2f}{r.cpu_s:>7.2f}{r.out_per_cpu_s:>15,.0f}{r.out_per_wall_s:>16,.0f}"
            f"{r.all_per_cpu_s:>15,.0f}{r.virtual_s / r.wall_s:>8.0f}x"
        )


def plot(results: list[Result], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [str(r.batch) for r in results]
    ax.bar(labels, [r.out_per_cpu_s for r in results], color="#b0420c")
    ax.axhline(TARGET, color="#2b6a24", linestyle="--", label="target 100k tok/s per core")
    ax.set_xlabel("running sequences (batch)")
    ax.set_ylabel("simulated output tokens per CPU second")
    ax.set_title("Simulated engine speed (virtual clock)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; the median is shown")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="FILE")
    args = parser.parse_args()
    reqs = workload(args.requests, args.seed)
    results = [median_run(b, reqs, args.repeat) for b in args.batches]
    print_table(results)
    best = max(r.out_per_cpu_s for r in results)
    median = statistics.median(r.out_per_cpu_s for r in results)
    verdict = "meets" if median >= TARGET else "misses"
    print(
        f"\nmedian over batch sizes: {median:,.0f} output tokens per CPU-second "
        f"(best {best:,.0f}); {verdict} the {TARGET:,} target"
    )
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
