"""The design's noisy-neighbour scenario through HTTP: real tenants, keys, gateway and worker.

The design's workload, in real time: a pool of 2,000 tokens/s with at most 500 per sequence
(the simulated engine with 4 sequences at 500 tokens/s each); three small tenants each send one
300-token request per second; from t=5 s to t=25 s a noisy tenant sends three 2,000-token
requests per second, three times the pool's capacity. Each request streams (``ignore_eos``, so
its cost is what it asks for) through uvicorn, admission, the WFQ dispatcher and a Celery pool
worker. With a budget, every tenant's output bucket is 1,000 tokens/s with a burst of 8,000
(the design's ``Budget(1000, 8000)``), charged at admission.

Reported per tenant group: time to first token p50 / p95 / max, 429s, overload 503s (shedding,
``gateway.inference.overload``; ``SHED_QUEUE_FACTOR=0`` turns it off) and tokens served.
Target: small tenants' TTFT p95 under 2 s with WFQ and budgets during the flood.
``--scale 0.5`` runs the same rates for half as long (30 s, flood from 2.5 s to 12.5 s).

The dispatcher's policy is the production one (WFQ); the FIFO rows need a policy setting in the
serving core, which this build's gateway does not expose, so they are not run over HTTP (the
in-process ``bench/noisy_neighbour.py`` compares FIFO and WFQ through the same scripts).

    python bench/http_noisy_neighbour.py [--scale 1.0] [--plot out.png]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from _http import System, TenantSpec, maybe_plot, percentile, sse_post, stream_body

SMALL = ("t1", "t2", "t3")
ENGINE = {"decode_tokens_per_s": 500.0, "pool_tokens_per_s": 2000.0}
BASE_QUOTA = {"input_tpm": 10**8, "output_tpm": 10**8, "concurrent_requests": 10_000,
              "open_streams": 10_000, "max_output_tokens": 4000, "ttft_deadline_s": 300,
              "total_deadline_s": 600}
BUDGET = {"output_tpm": 60_000, "output_burst": 8_000}


def workload(scale: float) -> list[tuple[float, str, int]]:
    out = []
    for t in range(int(60 * scale)):
        out += [(float(t), name, 300) for name in SMALL]
        if 5 * scale <= t < 25 * scale:
            out += [(t + k / 3, "noisy", 2000) for k in range(3)]
    return sorted(out)


async def run(system: System, scale: float, prompt_tokens: int) -> list[tuple[str, Any]]:
    start = time.perf_counter()

    async def send(at: float, tenant: str, cost: int) -> tuple[str, Any]:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        body = stream_body(system.model_name, max(1, cost - prompt_tokens))
        return tenant, await sse_post(system.urls[0], system.keys[tenant], body)

    return list(await asyncio.gather(*(send(*w) for w in workload(scale))))


def summarise(results: list[tuple[str, Any]], group: tuple[str, ...]) -> dict[str, Any]:
    mine = [r for t, r in results if t in group]
    ttfts = [r.ttft for r in mine if r.status == 200 and r.ttft is not None]
    return {
        "ttft": (percentile(ttfts, .5), percentile(ttfts, .95), max(ttfts, default=0.0)),
        "429": sum(r.status == 429 for r in mine),
        "503": sum(r.status == 503 for r in mine),
        "tokens": sum(r.completion_tokens for r in mine),
        "failed": sum(r.status not in (429, 503) and (r.status != 200 or bool(r.error))
                      for r in mine),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--seqs", type=int, default=4,
                        help="running sequences per engine (the pool rate is shared by them)")
    parser.add_argument("--plot")
    args = parser.parse_args()
    from serving.tokenization import load_tokenizer

    prompt = len(load_tokenizer(None).apply_chat_template(
        stream_body("x", 1)["messages"]))
    rows = []
    for label, quota in (("WFQ, no budget", BASE_QUOTA),
                         ("WFQ, budget 1,000 tok/s", {**BASE_QUOTA, **BUDGET})):
        tenants = [TenantSpec(name, quota=quota) for name in (*SMALL, "noisy")]
        engine = {**ENGINE, "decode_tokens_per_s": 2000.0 / args.seqs}
        with System(backend_settings=engine, max_sequences=args.seqs,
                    tenants=tenants) as system:
            results = asyncio.run(run(system, args.scale, prompt))
        rows.append((label, summarise(results, SMALL), summarise(results, ("noisy",))))
    print(f"\npool 2,000 tok/s ({args.seqs} x {2000 / args.seqs:g}); small tenants "
          f"3 x 300 tok/s; noisy 6,000 tok/s for {20 * args.scale:g} s. "
          "TTFT in seconds (p50 / p95 / max).\n")
    print(f"{'configuration':<26}{'small TTFT':>22}{'noisy TTFT':>22}{'small 429':>11}"
          f"{'noisy 429':>11}{'noisy 503':>11}{'small tok':>11}{'noisy tok':>11}")
    for label, small, noisy in rows:
        fmt = "{:.2f} / {:.2f} / {:.2f}"
        print(f"{label:<26}{fmt.format(*small['ttft']):>22}{fmt.format(*noisy['ttft']):>22}"
              f"{small['429']:>11}{noisy['429']:>11}{noisy['503']:>11}{small['tokens']:>11,}"
              f"{noisy['tokens']:>11,}")
        if small["failed"] or noisy["failed"] or small["503"]:
            print(f"  failed: small {small['failed']}, noisy {noisy['failed']}; "
                  f"small shed (503): {small['503']}")

    def draw(plt: Any) -> Any:
        fig, ax = plt.subplots()
        ax.bar([r[0] for r in rows], [r[1]["ttft"][1] for r in rows])
        ax.set_ylabel("small tenants' TTFT p95 (s)")
        return fig

    maybe_plot(args.plot, draw)


if __name__ == "__main__":
    main()
