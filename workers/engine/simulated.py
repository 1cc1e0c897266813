"""A simulated continuous-batching engine: the default backend for embedded mode, tests, benchmarks.

It runs no model, but it schedules like one (vLLM v1 is the reference):

- One engine loop; each step it picks the batch (iteration-level scheduling, Orca): every
  running sequence that is decoding gets one token, prompts are processed in chunks out of a
  per-step token budget (chunked prefill), and waiting sequences are admitted, by priority then
  arrival, while there is a free slot and their prompt's KV blocks fit.
- KV memory is a paged block pool (``kv_cache.BlockManager``) with a per-salt prefix cache. A
  decoding sequence that needs a new block when none is free preempts the newest running
  sequence, which goes back to waiting and is recomputed later.
- A step lasts as long as its work would on the modelled hardware (see ``SimConfig``), on the
  engine's clock: real time for serving, virtual time (``clock.VirtualClock``) for simulations.
- Output tokens are real ids of the model's tokenizer, drawn from a bigram model of the repo's
  corpus and deterministic for (seed, prompt), so the text that streams back is words.
- Sampling parameters act on the bigram distribution as they act on a model's logits:
  presence, frequency and repetition penalties, ``logit_bias``, ``min_tokens`` (end-of-sequence
  masked until then), temperature; ``logprobs`` reports the distribution the token was drawn
  from. Structured outputs (``json_schema``/``json_object``) emit a schema-valid document drawn
  for the request (``serving.guided``), token by token, then end-of-sequence. Offered
  tools under ``tool_choice: "auto"``, it calls one when the conversation asks for it, by the
  deterministic rule in ``workers.engine.simtools``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import math
import random
import re
from array import array
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from heapq import heappop, heappush
from pathlib import Path

from serving.guided import sample_json_bounded
from serving.schema_limits import check_bounds
from serving.tokenization import HFTokenizer, IncrementalDetokenizer, load_tokenizer
from workers.engine.base import (
    Engine,
    EngineError,
    EngineLoad,
    EngineRequest,
    FinishReason,
    TokenDelta,
    TokenLogprob,
    Usage,
    dimensions_refused,
)
from workers.engine.clock import Clock, RealClock
from workers.engine.kv_cache import BlockManager, BlockTable, ModelGeometry
from workers.engine.simtools import schema_in_prompt, tool_call_text

log = logging.getLogger(__name__)

CORPUS = Path(__file__).resolve().parent.parent / "assets" / "corpus" / "gateway_prose.txt"

WAITING, RUNNING, FINISHED = 0, 1, 2


@dataclass(frozen=True)
class Fault:
    """A failure to inject into one request, for testing the layers above the engine.

    kind "error": the request fails with ``EngineError`` once it has ``after_tokens`` output
    tokens (other requests carry on); "stall": the whole engine hangs for ``seconds`` at that
    point, as a stuck accelerator would; "invalid_tokens": from then on the request's tokens
    are ids outside the vocabulary (with empty text).
    """

    kind: str
    after_tokens: int = 0
    seconds: float = 0.0
    retryable: bool = True
    message: str = "injected engine fault"


@dataclass(frozen=True)
class SimConfig:
    """The modelled hardware and scheduler. Defaults: the design's noisy-neighbour pool.

    Prefill and decode are budgeted apart, as the design asks and as real engines behave
    (docs/adr/0017: vLLM on the CPU prefills ~10x faster than it decodes). A step takes
    ``step_overhead_s + max(t_decode, t_prefill)``, the roofline of one batch:

    - ``t_decode = max(1 / decode_tokens_per_s, decodes / pool_tokens_per_s)`` if any sequence
      decodes: one token per sequence per step, memory-bound, at most ``decode_tokens_per_s``
      for one sequence and ``pool_tokens_per_s`` (the pool's decode rate) for all of them. So
      "2,000 tok/s pool, 500 per sequence" gives four sequences 500 tok/s each and eight 250;
    - ``t_prefill = prompt tokens / prefill_tokens_per_s``: compute-bound, its own budget.

    The batch follows vLLM's chunked-prefill limits: at most ``max_num_batched_tokens`` tokens
    a step, decodes included (unset: the running sequences plus ``prefill_chunk_tokens``); at
    most ``long_prefill_token_threshold`` prompt tokens of one request a step (0:
    no cap; None: what prefills in one full batch's decode step), so a long prompt is chunked,
    a short one beside it still gets its turn, and a step stays as short as a decode step; at
    most ``max_num_partial_prefills`` requests prefilling in one step (None: no limit). The
    step's prompt tokens go to the waiting and running prefills in priority order (lower
    first, ``EngineRequest.priority``, then arrival), as vLLM's priority scheduling does.
    """

    max_running_seqs: int = 64
    block_size: int = 16
    # KV capacity in tokens; None derives it from the geometry and the memory budget.
    kv_cache_tokens: int | None = None
    geometry: ModelGeometry = field(default_factory=ModelGeometry)
    kv_memory_bytes: int = 50 * 10**9
    # Blocks kept free at admission (fraction of all), so admission rarely forces preemption.
    kv_watermark: float = 0.01
    enable_prefix_caching: bool = True
    decode_tokens_per_s: float = 500.0
    pool_tokens_per_s: float | None = 2000.0
    prefill_tokens_per_s: float = 20_000.0
    prefill_chunk_tokens: int = 512
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None  # None: one decode step's worth (below)
    max_num_partial_prefills: int | None = None
    step_overhead_s: float = 0.0
    max_model_len: int = 8192
    seed: int = 0
    model_dir: str | None = None
    embedding_dim: int = 384  # width of the simulated embedding vectors
    fail_request_ids: frozenset[str] = frozenset()
    faults: Callable[[EngineRequest], Fault | None] | None = None

    def __post_init__(self) -> None:
        positive = ("max_running_seqs", "block_size", "prefill_chunk_tokens", "max_model_len")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"SimConfig.{name} must be at least 1")
        for name in ("max_num_batched_tokens", "max_num_partial_prefills"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"SimConfig.{name} must be at least 1")
        if (self.long_prefill_token_threshold or 0) < 0:
            raise ValueError("SimConfig.long_prefill_token_threshold must be >= 0")
        if self.decode_tokens_per_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise ValueError("SimConfig rates must be positive")

    @property
    def step_tokens(self) -> int:
        """Tokens one step may compute, decodes included (vLLM's max_num_batched_tokens).

        Unset: every running sequence's decode plus one ``prefill_chunk_tokens`` of prompt. A
        budget below the running count would leave no room to admit anyone while the batch is
        full of decodes (vLLM refuses ``max_num_batched_tokens < max_num_seqs`` for that
        reason): with 1,000 streams a worker stalled at 512 running and its queue waited."""
        return self.max_num_batched_tokens or self.max_running_seqs + self.prefill_chunk_tokens

    def chunk_cap(self) -> int:
        """Prompt tokens one request may compute in one step."""
        threshold = self.long_prefill_token_threshold
        if threshold is None:
            # What prefills in the time of one full batch's decode step: a long prompt's chunk
            # rides on the decode step without making it longer, so the sequences decoding
            # beside it keep their rate (stall-free batching, Sarathi-Serve; ADR 0017).
            step = 1.0 / self.decode_tokens_per_s
            if self.pool_tokens_per_s:
                step = max(step, self.max_running_seqs / self.pool_tokens_per_s)
            threshold = max(16, int(self.prefill_tokens_per_s * step))
        return threshold or self.step_tokens

    def kv_tokens(self) -> int:
        if self.kv_cache_tokens is not None:
            return self.kv_cache_tokens
        return self.geometry.kv_tokens(self.kv_memory_bytes)

    def step_seconds(self, decode_seqs: int, prefill_tokens: int) -> float:
        t = 1.0 / self.decode_tokens_per_s if decode_seqs else 0.0
        if self.pool_tokens_per_s:
            t = max(t, decode_seqs / self.pool_tokens_per_s)
        return self.step_overhead_s + max(t, prefill_tokens / self.prefill_tokens_per_s)


@dataclass(frozen=True)
class MarkovModel:
    """Bigram successors of each token id over the corpus, paragraphs closed by EOS."""

    successors: tuple[tuple[int, ...], ...]
    greedy: tuple[int, ...]  # most frequent successor (temperature 0)
    starts: tuple[int, ...]  # paragraph openings, for contexts the corpus never saw


@lru_cache(maxsize=4)
def markov_model(tokenizer: HFTokenizer) -> MarkovModel:
    paragraphs = [p for p in CORPUS.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    eos = tokenizer.eos_token_id
    chain: list[int] = []
    starts: list[int] = []
    for text in paragraphs:
        ids = tokenizer.encode(text.strip())
        starts.append(ids[0])
        chain += ids + ([eos] if eos is not None else [])
    chain.append(chain[0])  # cyclic: after the last paragraph's EOS comes the first again
    succ: list[list[int]] = [[] for _ in range(tokenizer.vocab_size)]
    for a, b in itertools.pairwise(chain):
        succ[a].append(b)
    greedy = tuple(max(set(s), key=s.count) if s else starts[0] for s in succ)
    return MarkovModel(tuple(tuple(s) for s in succ), greedy, tuple(starts))


@lru_cache(maxsize=1)
def corpus_words() -> tuple[str, ...]:
    """Distinct plain words of the corpus: string content for structured outputs."""
    text = CORPUS.read_text(encoding="utf-8")
    return tuple(sorted({w.lower() for w in re.findall(r"[A-Za-z]{3,12}", text)}))


# Logit of a token the bigram model never saw after the current one (before any bias).
UNSEEN_LOGIT = -12.0


def _distribution(m: MarkovModel, last: int) -> dict[int, float]:
    """log P(next | last) under the bigram model, as a model's log-softmaxed logits."""
    succ = m.successors[last] or m.starts
    counts: dict[int, int] = {}
    for tok in succ:
        counts[tok] = counts.get(tok, 0) + 1
    total = len(succ)
    return {tok: math.log(c / total) for tok, c in counts.items()}


def _log_softmax(logits: dict[int, float]) -> dict[int, float]:
    top = max(logits.values())
    norm = top + math.log(sum(math.exp(v - top) for v in logits.values()))
    return {t: v - norm for t, v in logits.items()}


@lru_cache(maxsize=65536)
def _token_vector(token_id: int, width: int) -> tuple[float, ...]:
    rng = random.Random(token_id * 7919 + width)
    return tuple(rng.gauss(0.0, 1.0) for _ in range(width))


def _embedding(ids: list[int], width: int, keep: int) -> list[float]:
    total = [0.0] * keep
    for tok in ids:
        vec = _token_vector(tok, width)
        for j in range(keep):
            total[j] += vec[j]
    norm = math.sqrt(sum(v * v for v in total)) or 1.0
    return [v / norm for v in total]


def _seed_for(seed: int, prompt: list[int]) -> int:
    # Stable across processes (unlike hash()): the same (seed, prompt) gives the same output.
    data = array("q", [seed % 2**63, *prompt]).tobytes()
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "little")


class _Seq:
    """One request inside the engine."""

    __slots__ = (
        "arrival",
        "cached",
        "detok",
        "fault",
        "finish_len",
        "forced",
        "last",
        "n_out",
        "num_computed",
        "out",
        "prompt_len",
        "req",
        "result",
        "rng",
        "sampler",
        "sent",
        "sink",
        "status",
        "stop_ids",
        "stops",
        "table",
        "text",
        "tokens",
        "waiter",
    )

    def __init__(self, req: EngineRequest, arrival: int, eos: int | None, fault: Fault | None,
                 detok: IncrementalDetokenizer) -> None:
        sp = req.sampling
        self.req = req
        self.arrival = arrival
        self.prompt_len = len(req.prompt_token_ids)
        self.tokens = list(req.prompt_token_ids)  # the context: prompt, then output ids
        self.status = WAITING
        self.table = BlockTable(req.cache_salt)
        self.num_computed = 0  # leading tokens of the context whose KV is computed
        self.n_out = 0
        self.cached = -1  # cached prompt tokens at first admission (-1: not admitted yet)
        self.last = req.prompt_token_ids[-1]
        stop_ids = set(sp.stop_token_ids)
        if eos is not None and not sp.ignore_eos:
            stop_ids.add(eos)
        self.stop_ids = frozenset(stop_ids)
        self.stops = tuple(s for s in sp.stop if s)
        self.text = ""  # output text so far, kept only to find stop strings
        self.sent = 0  # characters of ``text`` already streamed
        self.fault = fault
        self.out: deque[TokenDelta | EngineError] = deque()
        self.waiter: asyncio.Future[None] | None = None
        # stream(): deltas go straight to ``sink`` inside the step; the last one (or the
        # error) resolves ``result``. generate() uses ``out`` and ``waiter`` instead.
        self.sink: Callable[[TokenDelta], None] | None = None
        self.result: asyncio.Future[TokenDelta] | None = None
        self.rng: Callable[[], float] | None = None
        self.detok = detok
        self.finish_len = 0
        # Structured outputs: the document's token ids still to emit (None: unconstrained).
        self.forced: deque[int] | None = None
        # True when sampling needs the full distribution (penalties, bias, logprobs...).
        self.sampler = bool(sp.presence_penalty or sp.frequency_penalty or sp.logit_bias
                            or sp.repetition_penalty != 1.0 or sp.min_tokens
                            or sp.logprobs is not None)

    def usage(self) -> Usage:
        return Usage(self.prompt_len, max(self.cached, 0), self.n_out)


class SimulatedEngine(Engine):
    def __init__(self, config: SimConfig | None = None, clock: Clock | None = None) -> None:
        self.config = cfg = config or SimConfig()
        self.clock: Clock = clock or RealClock()
        self._tok = load_tokenizer(cfg.model_dir)
        self._markov = markov_model(self._tok)
        bs = cfg.block_size
        self.blocks = BlockManager(cfg.kv_tokens() // bs, bs, cfg.enable_prefix_caching)
        self._reserve = int(cfg.kv_watermark * self.blocks.num_blocks)
        if self.blocks.blocks_for(cfg.max_model_len) > self.blocks.num_blocks - self._reserve:
            # As vLLM refuses to start: one sequence at full context must fit on its own, or
            # it could be preempted forever.
            raise ValueError(
                f"KV cache of {self.blocks.num_blocks * bs} tokens cannot hold one sequence "
                f"of max_model_len={cfg.max_model_len}"
            )
        self._seqs: dict[str, _Seq] = {}
        self._running: list[_Seq] = []  # admission order: the newest is preempted first
        self._waiting: list[tuple[int, int, _Seq]] = []  # heap (priority, arrival, seq)
        self._n_waiting = 0
        self._arrivals = 0
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._stall_until = 0.0
        self._step_end = float("-inf")
        self._step_len = 0.0
        # Called after every engine step (tests check invariants here, benchmarks sample load).
        self.on_step: Callable[[SimulatedEngine], None] | None = None
        self.stats = {"steps": 0, "preemptions": 0, "prompt_tokens_computed": 0, "output_tokens": 0}

    # -- Engine interface -----------------------------------------------------------------

    @property
    def tokenizer(self) -> HFTokenizer:
        return self._tok

    async def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="sim-engine")

    async def stop(self) -> None:
        for seq in list(self._seqs.values()):
            self._finish(seq, FinishReason.ABORT)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def generate(self, request: EngineRequest) -> AsyncGenerator[TokenDelta, None]:
        seq = self._submit(request)
        loop = asyncio.get_running_loop()
        try:
            while True:
                while not seq.out:
                    seq.waiter = loop.create_future()
                    await seq.waiter
                item = seq.out.popleft()
                if type(item) is not TokenDelta:
                    raise item  # type: ignore[misc]
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Consumer closed or cancelled before the end: that is an abort (as in vLLM).
            if seq.status != FINISHED:
                self._finish(seq, FinishReason.ABORT)

    async def stream(self, request: EngineRequest,
                     on_delta: Callable[[TokenDelta], None]) -> TokenDelta | None:
        """Deltas reach ``on_delta`` from inside the engine step that made them (no task switch
        per token); the caller wakes once, at the end (see ``Engine.stream``)."""
        seq = self._submit(request)
        seq.sink = on_delta
        seq.result = asyncio.get_running_loop().create_future()
        try:
            return await seq.result
        finally:
            if seq.status != FINISHED:  # the caller was cancelled: that is an abort
                self._finish(seq, FinishReason.ABORT)

    async def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._finish(seq, FinishReason.ABORT)
            if self._wake is not None:
                self._wake.set()  # freed blocks may let a waiter in

    async def embed(self, request_id: str, prompts: list[list[int]],
                    dimensions: int | None = None) -> list[list[float]]:
        """Deterministic embeddings: the normalised sum of a fixed random vector per token, so
        texts sharing tokens point the same way. ``dimensions`` keeps the leading components
        and renormalises (as Matryoshka-trained models are shortened). Costs the prompts'
        prefill time on the engine's clock."""
        width = self.config.embedding_dim
        if dimensions is not None and not 1 <= dimensions <= width:
            raise dimensions_refused(dimensions, f"its embeddings have {width}")
        for ids in prompts:
            if not ids or min(ids) < 0 or max(ids) >= self._tok.vocab_size:
                raise EngineError("prompt has token ids outside the vocabulary",
                                  retryable=False)
        tokens = sum(len(p) for p in prompts)
        await self.clock.sleep(tokens / self.config.prefill_tokens_per_s)
        return [_embedding(ids, width, dimensions or width) for ids in prompts]

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.config.prefill_tokens_per_s

    def load(self) -> EngineLoad:
        bm = self.blocks
        return EngineLoad(
            running=len(self._running),
            waiting=self._n_waiting,
            max_running=self.config.max_running_seqs,
            kv_tokens_used=bm.used_blocks * bm.block_size,
            kv_tokens_total=bm.num_blocks * bm.block_size,
            extra={
                "kv_blocks_cached": float(bm.cached_blocks),
                "preemptions": float(self.stats["preemptions"]),
                "steps": float(self.stats["steps"]),
            },
        )

    def check_invariants(self) -> None:
        """Assert KV accounting: block pool invariants, refcounts match running sequences."""
        self.blocks.check([s.table for s in self._running])
        for _, _, seq in self._waiting:
            assert seq.status == FINISHED or not seq.table.blocks, "waiting sequence holds blocks"
        assert self._n_waiting == sum(1 for *_, s in self._waiting if s.status == WAITING)

    # -- submission -----------------------------------------------------------------------

    def _submit(self, req: EngineRequest) -> _Seq:
        if self._task is None or self._wake is None:
            raise EngineError("engine is not running", retryable=True)
        self._validate(req)
        fault = Fault("error") if req.request_id in self.config.fail_request_ids else None
        if fault is None and self.config.faults is not None:
            fault = self.config.faults(req)
        seq = _Seq(req, self._arrivals, self._tok.eos_token_id, fault, self._tok.detokenizer())
        self._arrivals += 1
        seed = req.sampling.seed if req.sampling.seed is not None else self.config.seed
        if req.sampling.temperature > 0:
            seq.rng = random.Random(_seed_for(seed, req.prompt_token_ids)).random
        if req.sampling.constrained:
            seq.forced = self._document(req, seed)
        elif req.sampling.may_call_tools:
            seq.forced = self._tool_call(req, seed)
        seq.finish_len = min(seq.prompt_len + req.sampling.max_tokens, self.config.max_model_len)
        self._seqs[req.request_id] = seq
        heappush(self._waiting, (req.priority, seq.arrival, seq))
        self._n_waiting += 1
        self._wake.set()
        return seq

    def _document(self, req: EngineRequest, seed: int) -> deque[int]:
        """The token ids of a schema-valid document for this request (see the module doc)."""
        sp = req.sampling
        schema = json.loads(sp.json_schema) if sp.json_schema is not None else None
        if schema is None:  # json_object: the schema the prompt asks for, if it holds one
            prompt = self._tok.decode(req.prompt_token_ids, skip_special_tokens=False)
            schema = schema_in_prompt(prompt)
        # The work is bounded by what will be emitted (max_tokens), not by the schema's
        # minItems or minLength: start with a budget that usually covers max_tokens and
        # double it only while a cut-short document is still shorter than that.
        budget, most = sp.max_tokens * 8 + 256, sp.max_tokens * 64 + 4096
        words = list(corpus_words())
        while True:
            rng = random.Random(_seed_for(seed + 1, req.prompt_token_ids))
            try:
                if schema is not None:
                    check_bounds(schema)
                text, cut = sample_json_bounded(schema, rng, words, budget)
            except (ValueError, RecursionError, TypeError, KeyError, IndexError,
                    AttributeError) as exc:
                raise EngineError(f"cannot decode to this JSON schema: {exc}",
                                  retryable=False) from None
            ids = self._tok.encode(text)
            if not cut or len(ids) > sp.max_tokens + 1 or budget >= most:
                return deque(ids)
            budget *= 2

    def _tool_call(self, req: EngineRequest, seed: int) -> deque[int] | None:
        """The token ids of the tool call this prompt calls for, or None to answer in text
        (the rule: ``workers.engine.simtools``)."""
        prompt = self._tok.decode(req.prompt_token_ids, skip_special_tokens=False)
        call = tool_call_text(prompt, random.Random(_seed_for(seed + 2, req.prompt_token_ids)))
        return deque(self._tok.encode(call)) if call is not None else None

    def _validate(self, req: EngineRequest) -> None:
        ids, cfg = req.prompt_token_ids, self.config
        if req.request_id in self._seqs:
            raise EngineError(f"request id {req.request_id!r} is already running", retryable=False)
        if not ids:
            raise EngineError("empty prompt", refused=True)
        if req.sampling.max_tokens < 1:
            raise EngineError("max_tokens must be at least 1", refused=True)
        if min(ids) < 0 or max(ids) >= self._tok.vocab_size:
            raise EngineError("prompt has token ids outside the vocabulary", refused=True)
        if len(ids) >= cfg.max_model_len:
            raise EngineError(
                f"prompt of {len(ids)} tokens exceeds the context window ({cfg.max_model_len})",
                refused=True,
            )
        if self.blocks.blocks_for(len(ids) + 1) > self.blocks.num_blocks - self._reserve:
            raise EngineError("prompt does not fit in the KV cache", refused=True)

    # -- the engine loop ------------------------------------------------------------------

    async def _loop(self) -> None:
        assert self._wake is not None
        clock = self.clock
        while True:
            if not self._running and not self._n_waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._stall_until > clock.now():
                await clock.sleep(self._stall_until - clock.now())
            try:
                start = clock.now()
                if start - self._step_end < max(0.005, self._step_len):
                    # Back to back with the last step, late by less than a step: our own
                    # Python time (emitting 1,000 deltas, say) overlaps the modelled step, as
                    # a real engine's CPU scheduling overlaps its accelerator's work, so the
                    # configured rates hold. Later than that, the engine was idle or starved
                    # of CPU: start afresh rather than burst to catch up.
                    start = self._step_end
                plan, n_decode, n_prefill = self._schedule()
                if not plan:
                    # Nothing can run (the head waiter does not fit yet): wait for a change.
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._step_len = self.config.step_seconds(n_decode, n_prefill)
                self._step_end = start + self._step_len
                await clock.sleep(max(0.0, self._step_end - clock.now()))
                self._complete(plan)
                if self.on_step is not None:
                    self.on_step(self)
            except Exception:  # the loop must outlive a bug: fail what was in flight, go on
                log.exception("simulated engine step failed")
                for seq in list(self._seqs.values()):
                    self._fail(seq, EngineError("engine step failed", retryable=True))

    def _schedule(self) -> tuple[list[tuple[_Seq, int]], int, int]:
        """Pick this step's batch: (sequence, tokens to compute) pairs, decodes, prompt tokens.

        As vLLM's V1 scheduler: running sequences first, then waiting ones are admitted. Every
        decode gets its token (and counts against ``max_num_batched_tokens``); prompt tokens
        go to running prefills by priority, each at most ``chunk_cap()`` a step, then to
        waiters by priority; at most ``max_num_partial_prefills`` prefills a step.
        """
        cfg = self.config
        plan: list[tuple[_Seq, int]] = []
        n_decode = 0
        prefills: list[_Seq] = []
        for seq in list(self._running):
            if seq.status != RUNNING:
                continue  # preempted earlier in this pass
            if seq.prompt_len + seq.n_out - seq.num_computed == 1:
                if not self._reserve_slot(seq):
                    continue
                n_decode += 1
                plan.append((seq, 1))
            else:
                prefills.append(seq)
        budget = cfg.step_tokens - n_decode
        partial = cfg.max_num_partial_prefills or cfg.max_running_seqs
        prefills.sort(key=lambda s: (s.req.priority, s.arrival))
        for seq in prefills:
            if budget <= 0 or partial <= 0:
                break
            if seq.status != RUNNING:
                continue  # a decode above preempted it
            n = min(seq.prompt_len + seq.n_out - seq.num_computed, budget, cfg.chunk_cap())
            budget -= n
            partial -= 1
            plan.append((seq, n))
        left, admitted_decodes = self._admit(plan, budget, partial)
        prompt_tokens = cfg.step_tokens - n_decode - left - admitted_decodes
        return plan, n_decode + admitted_decodes, prompt_tokens

    def _reserve_slot(self, seq: _Seq) -> bool:
        """A block for the token this decode step computes; preempt the newest if none is free."""
        while not self.blocks.append_slot(seq.table, seq.num_computed + 1):
            victim = self._running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, plan: list[tuple[_Seq, int]], budget: int,
               partial: int) -> tuple[int, int]:
        """Admit waiters into free slots and blocks; returns (budget left, decode-like steps)."""
        cfg, bm = self.config, self.blocks
        decodes = 0
        while (self._waiting and len(self._running) < cfg.max_running_seqs and budget > 0
               and partial > 0):
            seq = self._waiting[0][2]
            if seq.status != WAITING:
                heappop(self._waiting)  # finished while waiting (aborted): drop the entry
                continue
            tokens = seq.tokens  # prompt and output so far: a preempted sequence recomputes both
            cached = bm.allocate(seq.table, seq.req.cache_salt, tokens, self._reserve)
            if cached is None:
                break  # the best waiter does not fit; later ones must not jump it (FCFS)
            heappop(self._waiting)
            self._n_waiting -= 1
            seq.status = RUNNING
            seq.num_computed = cached
            if seq.cached < 0:
                seq.cached = cached
            self._running.append(seq)
            todo = len(tokens) - cached
            if todo == 1:  # all but the last token cached: costs what a decode step does
                decodes += 1
                budget -= 1
                plan.append((seq, 1))
            else:
                n = min(todo, budget, cfg.chunk_cap())
                budget -= n
                partial -= 1
                plan.append((seq, n))
        return budget, decodes

    def _preempt(self, seq: _Seq) -> None:
        self.blocks.free(seq.table)
        seq.num_computed = 0
        seq.status = WAITING
        self._running.remove(seq)
        heappush(self._waiting, (seq.req.priority, seq.arrival, seq))
        self._n_waiting += 1
        self.stats["preemptions"] += 1

    # -- finishing a step -----------------------------------------------------------------

    def _complete(self, plan: list[tuple[_Seq, int]]) -> None:
        bm, bs = self.blocks, self.blocks.block_size
        stats = self.stats
        stats["steps"] += 1
        finished = False
        for seq, n in plan:
            if seq.status != RUNNING:
                continue  # aborted while the step ran
            seq.num_computed += n
            if n > 1:
                stats["prompt_tokens_computed"] += n
            if seq.num_computed // bs > seq.table.hashed:
                bm.commit(seq.table, seq.tokens, seq.num_computed)
            if seq.num_computed == seq.prompt_len + seq.n_out:
                finished |= self._emit(seq)
        if finished:
            self._running = [s for s in self._running if s.status == RUNNING]

    def _emit(self, seq: _Seq) -> bool:
        """Sample the sequence's next token and stream it. True if the sequence finished."""
        if seq.fault is not None and seq.n_out >= seq.fault.after_tokens and self._inject(seq):
            return True
        m = self._markov
        logprobs: tuple[TokenLogprob, ...] | None = None
        if seq.forced is not None:
            tok = self._forced_next(seq)
            if seq.req.sampling.logprobs is not None:  # forced: the only allowed token
                logprobs = (TokenLogprob(tok, 0.0, ((tok, 0.0),)[: seq.req.sampling.logprobs]),)
        elif seq.sampler:
            tok, logprobs = self._sample(seq)
        else:
            succ = m.successors[seq.last]
            if seq.rng is None:
                tok = m.greedy[seq.last]
            elif succ:
                tok = succ[int(seq.rng() * len(succ))]
            else:
                tok = m.starts[int(seq.rng() * len(m.starts))]
        seq.last = tok
        fault = seq.fault
        if fault is not None and fault.kind == "invalid_tokens" and seq.n_out >= fault.after_tokens:
            tok = self._tok.vocab_size + seq.n_out  # the bug under test: not a vocabulary id
            text = ""
        else:
            text = seq.detok.push_one(tok)
        seq.tokens.append(tok)
        seq.n_out += 1
        self.stats["output_tokens"] += 1
        reason = FinishReason.STOP if tok in seq.stop_ids else None
        hit = False
        if seq.stops:
            text, hit = self._stop_strings(seq, text)
            if hit:
                reason = FinishReason.STOP
        if reason is None and seq.prompt_len + seq.n_out >= seq.finish_len:
            reason = FinishReason.LENGTH
        if reason is None:
            self._push(seq, TokenDelta([tok], text, logprobs=logprobs))
            return False
        self._finish(seq, reason, [tok], text, stop_hit=hit, logprobs=logprobs)
        return True

    def _forced_next(self, seq: _Seq) -> int:
        """Constrained decoding: the document's next token, then end-of-sequence."""
        assert seq.forced is not None
        if seq.forced:
            return seq.forced.popleft()
        eos = self._tok.eos_token_id
        seq.stop_ids = seq.stop_ids | {eos} if eos is not None else seq.stop_ids
        return eos if eos is not None else self._tok.encode(" ")[0]

    def _sample(self, seq: _Seq) -> tuple[int, tuple[TokenLogprob, ...] | None]:
        """Sample from the bigram distribution after penalties and bias, as vLLM's sampler does
        on logits: repetition (prompt and output), frequency and presence (output), bias, and
        no end-of-sequence before ``min_tokens``."""
        sp = seq.req.sampling
        logits = dict(_distribution(self._markov, seq.last))
        for tok, bias in sp.logit_bias:
            if 0 <= tok < self._tok.vocab_size:
                logits[tok] = logits.get(tok, UNSEEN_LOGIT) + bias
        if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty:
            output = seq.tokens[seq.prompt_len:]
            counts: dict[int, int] = {}
            for tok in output:
                counts[tok] = counts.get(tok, 0) + 1
            seen = set(seq.tokens) if sp.repetition_penalty != 1.0 else set()
            for tok in logits:
                if tok in seen:
                    v = logits[tok]
                    logits[tok] = v / sp.repetition_penalty if v > 0 else v * sp.repetition_penalty
                c = counts.get(tok, 0)
                if c:
                    logits[tok] -= sp.frequency_penalty * c + sp.presence_penalty
        if seq.n_out < sp.min_tokens:
            for tok in seq.stop_ids:
                logits.pop(tok, None)
            if not logits:
                logits = {t: 0.0 for t in self._markov.starts}
        logp = _log_softmax(logits)
        # Ties go to the token plain greedy decoding picks, so asking for logprobs alone never
        # changes the output.
        preferred = self._markov.greedy[seq.last]
        ranked = sorted(logp.items(), key=lambda kv: (-kv[1], kv[0] != preferred, kv[0]))
        if seq.rng is None or sp.temperature <= 0:
            tok = ranked[0][0]
        else:
            weights = [math.exp((v - ranked[0][1]) / sp.temperature) for _, v in ranked]
            pick = seq.rng() * sum(weights)
            tok = ranked[-1][0]
            for (cand, _), w in zip(ranked, weights, strict=True):
                pick -= w
                if pick <= 0:
                    tok = cand
                    break
        if sp.logprobs is None:
            return tok, None
        top = tuple(ranked[: sp.logprobs])
        return tok, (TokenLogprob(tok, logp[tok], top),)

    def _stop_strings(self, seq: _Seq, text: str) -> tuple[str, bool]:
        """Find stop strings in the output; hold back text that could be the start of one."""
        before = len(seq.text)
        seq.text += text
        longest = max(len(s) for s in seq.stops)
        start = max(0, before - longest + 1)
        hits = [i for i in (seq.text.find(s, start) for s in seq.stops) if i >= 0]
        if hits:
            seq.text = seq.text[: min(hits)]
            out = seq.text[seq.sent :]
            seq.sent = len(seq.text)
            return out, True
        upto = max(seq.sent, len(seq.text) - longest + 1)
        out = seq.text[seq.sent : upto]
        seq.sent = upto
        return out, False

    def _inject(self, seq: _Seq) -> bool:
        fault = seq.fault
        assert fault is not None
        if fault.kind == "error":
            self._fail(seq, EngineError(fault.message, retryable=fault.retryable))
            return True
        if fault.kind == "stall":
            self._stall_until = self.clock.now() + fault.seconds
            seq.fault = None
        return False

    def _push(self, seq: _Seq, item: TokenDelta | EngineError) -> None:
        if seq.result is not None:
            self._deliver(seq, item)
            return
        seq.out.append(item)
        waiter = seq.waiter
        if waiter is not None:
            seq.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _deliver(self, seq: _Seq, item: TokenDelta | EngineError) -> None:
        result = seq.result
        assert result is not None and seq.sink is not None
        if type(item) is TokenDelta:
            try:
                seq.sink(item)
                if item.finish_reason is None:
                    return
            except Exception as exc:  # the caller's bug fails its request, not the step
                log.exception("stream callback failed for %s", seq.req.request_id)
                if seq.status != FINISHED:
                    self._release(seq)
                item = EngineError(f"stream callback failed: {exc}", retryable=True,
                                   usage=seq.usage())
        if not result.done():
            if isinstance(item, EngineError):
                result.set_exception(item)
            else:
                result.set_result(item)

    def _release(self, seq: _Seq, unlist: bool = True) -> None:
        """Take the sequence out of the engine and free its KV blocks (now, not next step).

        ``unlist=False`` leaves it in the running list for the end-of-step sweep (``_complete``
        drops every finished sequence in one pass instead of one ``list.remove`` each).
        """
        if seq.status == RUNNING:
            self.blocks.free(seq.table)
            if unlist and seq in self._running:
                self._running.remove(seq)
        elif seq.status == WAITING:
            self._n_waiting -= 1  # its heap entry is dropped lazily
        seq.status = FINISHED
        self._seqs.pop(seq.req.request_id, None)

    def _finish(
        self,
        seq: _Seq,
        reason: str,
        token_ids: list[int] | None = None,
        text: str = "",
        stop_hit: bool = False,
        logprobs: tuple[TokenLogprob, ...] | None = None,
    ) -> None:
        if seq.status == FINISHED:
            return
        self._release(seq, unlist=reason == FinishReason.ABORT)
        if not stop_hit:  # after a stop string, nothing more of the text is shown
            tail = seq.detok.flush() if seq.detok is not None else ""
            if seq.stops:
                seq.text += tail
                tail = seq.text[seq.sent :]
            text += tail
        self._push(seq, TokenDelta(token_ids or [], text, reason, seq.usage(),
                                   logprobs=logprobs if token_ids else None))

    def _fail(self, seq: _Seq, error: EngineError) -> None:
        if seq.status == FINISHED:
            return
        self._release(seq)
        error.usage = seq.usage()
        self._push(seq, error)
