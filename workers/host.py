"""The engine host: one engine per Celery worker process, fed by the WFQ dispatcher.

``celery -A gateway worker --engine-pool NAME`` adds ``EngineHostStep`` to the worker. It builds
the pool's engine from its ``Pool`` row (``workers.engine.registry.build_engine``: a bad backend
or setting fails the worker's start with a message naming the pool) and runs, on an asyncio
loop in its own thread:

- the dispatch loop: pulls the next requests from the pool's WFQ only while the engine has a
  free slot and KV room (``wfq.dispatch_many`` moves them atomically into this worker's
  in-flight set and claims them, payload included, in the same script), and otherwise waits on
  a local signal: set in-process when a slot frees, and by a task that waits in ``BLPOP`` on the
  pool's wake list (pushed by every admission) while the loop is idle, so it wakes at once
  without busy-polling and without a Redis round trip to wake itself;
- one consumer task per running request, pumping engine deltas into the step batch; the
  flusher writes each step's batch in one pipeline (``transport.StepBatch``), and a request's
  settlement (with the engine's own usage) rides in the same pipeline after its last tokens;
- the cancel subscriber (``cancel:{pool}``): aborts the engine sequence within one step;
- the sweep, every ``RECONCILE_S``, one round trip (``_sweep``): settles what the in-flight
  set holds and this worker does not run, and reads the cancel flags of what it runs, so a
  cancel whose PUBLISH it missed (its subscriber was reconnecting) still stops the sequence,
  a second late rather than never (I5's backstop);
- heartbeats (``workers:{pool}``, every ``WORKER_HEARTBEAT_SECONDS``) with load and capacity;
- the janitor (``serving.janitor``), as in every worker;
- the engine watchdog: an engine whose core died (``Engine.failure()``, e.g. vLLM's engine
  core process killed) takes no more work; the heartbeat says ``healthy=0`` with no capacity,
  so the gateway routes elsewhere; its running requests are aborted and end with a retryable
  ``engine_restart`` error, settled with the counts the engine had; then the engine is started
  again. After ``MAX_ENGINE_RESTARTS`` restarts, or a restart that fails, the host leaves the
  pool and the worker process exits non-zero, for its supervisor to replace it.

Celery never carries a generation: the worker's Celery consumer only runs short tasks
(``workers.tasks``), so a redelivered Celery message cannot re-run anything (ADR 0002).

Warm shutdown (SIGTERM, or Celery's stop): stop dispatching, let the running sequences finish
(for at most ``WORKER_DRAIN_SECONDS``; what is still running then is aborted and ends with a
retryable ``worker_shutdown`` error, settled with the engine's counts), leave the pool, stop
the engine.
Requests still queued stay queued for the pool's other workers.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import redis
from celery import bootsteps
from celery.signals import worker_shutting_down
from django.conf import settings

from infra import quietlog, tracing
from infra.redis_conn import cluster_mode, get_async_redis, is_outage, new_async_pubsub_client
from serving import janitor, settlement, transport
from serving.keys import inflight_key, pools_key, req_key, wake_key, worker_key, workers_key
from serving.lua import script
from serving.settlement import Status
from serving.wfq import AsyncWfq, Dispatched, DispatchedItem, EngineShares
from serving.wire import PAYLOAD_FIELDS, text, unpack_prompt, unpack_sampling, usage_of
from workers.engine.base import (
    Engine,
    EngineError,
    EngineRequest,
    FinishReason,
    TokenDelta,
    Usage,
)
from workers.engine.registry import EngineConfigError, EngineSpec, build_engine

log = logging.getLogger(__name__)

REFUSED = "engine_refused"  # the error code of a request the engine turned down (EngineError)
WAKE_TIMEOUT_S = 0.25  # an idle worker re-checks its queue at least this often
# How often a worker sweeps (_sweep): one pipeline of its in-flight set's SMEMBERS and its
# running requests' cancel flags (HGET).
RECONCILE_S = 1.0
ENGINE_CHECK_S = 0.5  # how often the watchdog asks the engine whether it is still alive
MAX_ENGINE_RESTARTS = 3  # restarts in one worker's life; past that it exits to be replaced
ENGINE_FAILED_EXIT = 70  # the worker's exit status when its engine cannot be revived
START_TIMEOUT_S = {"vllm": 1800.0}  # by backend: how long an engine may take to start
# A settle that meets a Redis outage is retried this long: a Sentinel failover takes seconds, and
# a request's state survives it on the promoted replica, so without the retry its stream would
# wait for a terminal event until the deadline sweep. Past this, the janitor's sweeps end it.
SETTLE_RETRY_S = 30.0
# Step batches go out at most this often. Engines that step (the simulated one, vLLM in
# process) hand the host a step's deltas at once; a worker relaying upstream servers gets each
# stream's chunks one by one, so without a floor every chunk of every stream was a batch of its
# own: a relay_step EVAL, and a wake of every gateway's XREAD, per token. With it, the chunks of
# all streams that arrive within the gap share one batch (and a stream's chunks one entry). A
# delta that arrives after a quiet gap goes out at once: the floor adds latency only under load.
FLUSH_GAP_S = 0.002


def new_worker_id(pool: str) -> str:
    return f"{pool}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class _Running:
    rid: str
    kv_tokens: int
    tenant: str = ""  # for the dispatcher's slot fairness (per-tenant running counts)
    tag: float = 0.0  # its WFQ finish tag: the engine's priority (lower runs first)
    # Prompt tokens not yet prefilled, for the dispatcher's prefill shares (rule E): its
    # kv_tokens until the prompt is known, the prompt's length until the first token.
    pending: int = 0
    cancel_reason: str = ""
    reaped: bool = False  # the janitor settled it already (this worker was declared dead)
    # A step batch with its tokens could not be written (Redis down or restarted): the stream
    # has a hole, so the request is aborted and ends with a retryable error; nothing more is
    # written to its stream (after a restart that would recreate keys without a TTL).
    broken: bool = False
    first_sent: bool = False  # its first tokens are in a step batch (stamps first_token_at)
    relayed: int = 0  # tokens handed to step batches: its entries' ids (relay_step.lua D1)
    entries: int = 0  # step batches that held its deltas: its entries' index (D1, R1)
    invalid: bool = False  # the engine sent ids outside the vocabulary: aborted, fails
    engine_failed: bool = False  # aborted because the engine died (retryable, see _recover)
    stream: asyncio.Future[Any] | None = None  # the engine.stream() call(s)
    # Framed requests (n choices, logprobs): the engine sequence of each choice, by index.
    choice_ids: tuple[str, ...] = ()
    choice_tasks: tuple[asyncio.Task[TokenDelta | None], ...] = ()
    embedding: bool = False  # an embeddings request: pooled, not generated
    # Tracing (infra.tracing), only while it is on: the gateway's context and when each phase
    # began (ns since the epoch), turned into spans when the request settles.
    trace: Any = None
    popped_ns: int = 0  # dispatched to this worker (the queue wait ends)
    submitted_ns: int = 0  # handed to the engine (prefill begins)
    first_ns: int = 0  # its first output (decode begins)
    # What the dispatcher's claim handed over (its payload, an early cancel), until _serve
    # gives the payload to the engine.
    claim: DispatchedItem | None = None

    @property
    def started(self) -> bool:
        """The sequence was submitted to the engine."""
        return self.stream is not None


class EngineHost:
    """Runs one engine for one pool on the current event loop (see the module docstring)."""

    def __init__(self, spec: EngineSpec, engine: Engine, worker_id: str | None = None, *,
                 heartbeat_s: float | None = None, dead_after_s: float | None = None,
                 drain_timeout_s: float | None = None,
                 max_engine_restarts: int = MAX_ENGINE_RESTARTS,
                 flush_gap_s: float = FLUSH_GAP_S) -> None:
        self.spec = spec
        self.engine = engine
        self.worker_id = worker_id or new_worker_id(spec.name)
        self.heartbeat_s = heartbeat_s or settings.WORKER_HEARTBEAT_SECONDS
        self.dead_after_s = dead_after_s or settings.WORKER_DEAD_AFTER_SECONDS
        self.drain_timeout_s = (settings.WORKER_DRAIN_SECONDS if drain_timeout_s is None
                                else drain_timeout_s)
        self.max_engine_restarts = max_engine_restarts
        self.flush_gap_s = flush_gap_s
        self.flushes = 0  # step batches written (diagnostics)
        self.engine_restarts = 0
        self.engine_failure: str | None = None  # set while the engine is dead or restarting
        # Why the host gave up (the engine could not be revived): the worker exits non-zero.
        self.fatal: BaseException | None = None
        self._engine_ok: asyncio.Event | None = None
        self.running: dict[str, _Running] = {}
        # Derived from running, kept as it changes (_start, _freed) rather than recounted on
        # every dispatch: this worker's sequences per tenant (slot fairness) and reserved KV.
        self._per_tenant: Counter[str] = Counter()
        self._kv_reserved = 0
        # Per tenant: prompt tokens waiting for prefill and KV tokens reserved here (rule E).
        self._prefill_by_tenant: Counter[str] = Counter()
        self._kv_by_tenant: Counter[str] = Counter()
        self.ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._batch = transport.StepBatch(pool=self.spec.name)
        self._waiters: list[asyncio.Future[Any]] = []
        self._flush_needed: asyncio.Event | None = None
        self._slot_freed: asyncio.Event | None = None
        # Work may be waiting: set by a slot freeing, a prefill ending, the drain (in-process,
        # no Redis round trip) and by the pool's wake list (_pool_wakes); the dispatch loop
        # waits on it when the queue gave it nothing.
        self._work: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None  # the dispatch loop is waiting on _work
        # Whether the last dispatch left requests queued in the pool (Dispatched.more): only
        # then can a slot or KV freed here start one (_wake_self).
        self._queued = True
        # Held while a dispatch's claims travel from Redis into self.running, so _sweep
        # never takes a request just claimed for one we do not run.
        self._dispatching: asyncio.Lock | None = None
        # Ids this worker had before the janitor reaped it (_rejoin): their in-flight sets are
        # reconciled too until empty.
        self._past_ids: list[str] = []
        self._redis: Any = None
        self._wfq: Any = None
        self._vocab: int | None = None  # the engine tokenizer's vocabulary size, read once

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def inflight(self) -> str:
        return inflight_key(self.spec.name, self.worker_id)

    def request_stop(self) -> None:
        """Thread-safe: begin the drain."""
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended: nothing to stop
                self._loop.call_soon_threadsafe(self._stop.set)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop, self._flush_needed = asyncio.Event(), asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._work, self._idle = asyncio.Event(), asyncio.Event()
        self._dispatching = asyncio.Lock()
        self._engine_ok = asyncio.Event()
        self._engine_ok.set()
        self._redis = get_async_redis()
        self._wfq = AsyncWfq(self._redis)
        await self.engine.start()
        await self._beat()  # registered before taking work, so a janitor can see us
        background = [self._flusher(), self._cancel_listener(), self._heartbeats(),
                      self._sweeps(), self._janitor(), self._engine_watchdog(),
                      self._pool_wakes()]
        bg_tasks = [asyncio.create_task(c) for c in background]
        dispatch = asyncio.create_task(self._dispatch_loop())
        self.ready.set()
        log.info("engine host %s serving pool %s", self.worker_id, self.spec.name)
        try:
            await self._stop.wait()
        finally:
            await self._drain(dispatch)
            for task in bg_tasks:
                task.cancel()
            await asyncio.gather(*bg_tasks, return_exceptions=True)
            with contextlib.suppress(Exception):  # a dead engine may fail to stop cleanly
                await self.engine.stop()
            await script("leave").run_async(self._redis, self._worker_keys(), [self.worker_id])
            log.info("engine host %s drained and left pool %s", self.worker_id, self.spec.name)

    async def _drain(self, dispatch: asyncio.Task[None]) -> None:
        self._draining = True
        assert self._slot_freed is not None and self._engine_ok is not None
        self._slot_freed.set()  # a dispatch loop waiting for a free slot sees the drain
        self._engine_ok.set()  # ... and one waiting for a restarted engine
        if self._work is not None:
            self._work.set()  # ... and one waiting for work
        await asyncio.gather(dispatch, return_exceptions=True)
        if self._tasks:
            log.info("draining %d running sequences", len(self._tasks))
            _, pending = await asyncio.wait(self._tasks, timeout=self.drain_timeout_s)
            if pending:
                for rid in list(self.running):
                    await self._abort(rid)
                await asyncio.wait(pending, timeout=10)
        await self._flush_once()

    def _worker_keys(self) -> list[str]:
        return [workers_key(self.spec.name), self.inflight,
                worker_key(self.spec.name, self.worker_id, "load")]

    # -- dispatch -----------------------------------------------------------------------------

    def _reserved_kv(self) -> int:
        return self._kv_reserved

    async def _dispatch_loop(self) -> None:
        assert self._slot_freed is not None and self._engine_ok is not None
        while not self._draining:
            if not self._engine_ok.is_set():  # the engine is being restarted: take no work
                await self._engine_ok.wait()
                continue
            free_slots = self.spec.max_sequences - len(self.running)
            if free_slots <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                if not self._queued and not self._draining:
                    await self._wait_for_work()  # a freed slot finds nothing queued
                continue
            assert self._work is not None and self._dispatching is not None
            self._work.clear()  # a wake from now on means: look again
            async with self._dispatching:
                items = await self._dispatch_once(free_slots)
            if items is None:
                await asyncio.sleep(WAKE_TIMEOUT_S)
            else:
                self._queued = items.more
                if len(items) < free_slots:  # the queue is empty or its head does not fit
                    await self._wait_for_work()

    async def _dispatch_once(self, free_slots: int) -> Dispatched | None:
        """Pop and claim up to free_slots requests and start them; None if Redis failed."""
        try:
            items: Dispatched = await self._wfq.dispatch_many(
                self.spec.name, n=free_slots, free_slots=free_slots,
                free_kv_tokens=max(0, self.spec.kv_cache_tokens - self._reserved_kv()),
                overcommit=self.spec.kv_overcommit, worker_id=self.worker_id,
                # This worker's own sequences per tenant: the dispatcher caps a tenant at its
                # weighted share of our slots while others are active (ADR 0006). Ours, so no
                # shared counter can be left wrong by an exit path.
                running=self._per_tenant, engine=self._engine_shares(),
                claim=PAYLOAD_FIELDS,  # dispatch.lua claims what it pops (K1, K2)
            )
        except Exception:
            # The script may have run with its reply lost: what it claimed is in our in-flight
            # set with nobody running it, which _sweep settles.
            log.exception("dispatch failed")
            return None
        for item in items:
            if item.claimed:  # else it was settled while queued: nothing to run (K1)
                self._start(item.request_id, item.kv_tokens, item.tenant_id, item.tag, item)
        return items

    async def _wait_for_work(self) -> None:
        """Until a wake (local, or the pool's list through _pool_wakes) or the timeout."""
        assert self._work is not None and self._idle is not None
        self._idle.set()
        try:
            await asyncio.wait_for(self._work.wait(), WAKE_TIMEOUT_S)
        except TimeoutError:
            pass
        finally:
            self._idle.clear()

    async def _pool_wakes(self) -> None:
        """While the dispatch loop is idle, wait in BLPOP on the pool's wake list (pushed by
        every admission, enter.lua) and turn a wake into the local signal. A wake that lands
        after this worker filled its slots is pushed back for another worker."""
        assert self._work is not None and self._idle is not None
        wake = wake_key(self.spec.name)
        while not _cancelling():
            await self._idle.wait()
            try:
                got = await self._redis.blpop([wake], timeout=WAKE_TIMEOUT_S)
                if got and len(self.running) >= self.spec.max_sequences:
                    await self._redis.lpush(wake, got[1])
                elif got:
                    self._work.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("waiting for work failed")
                await asyncio.sleep(WAKE_TIMEOUT_S)

    def _engine_shares(self) -> EngineShares:
        # Our engine's state for rule E (docs/adr/0017): each tenant's weighted share of the
        # prompt tokens it prefills over the horizon and of its KV cache. An engine with no
        # known prefill rate gets its KV cache as the prefill bound (KV shares only).
        kv = float(max(1, self.spec.kv_cache_tokens))
        rate = self.engine.prefill_tokens_per_s
        prefill = rate * settings.WFQ_PREFILL_HORIZON_SECONDS if rate else kv
        return EngineShares(prefill_capacity=max(1.0, prefill), kv_capacity=kv,
                            prefill=self._prefill_by_tenant, kv=self._kv_by_tenant)

    def _start(self, rid: str, kv_tokens: int, tenant: str = "", tag: float = 0.0,
               claim: DispatchedItem | None = None) -> None:
        if rid in self.running:
            # Handed out again: a failover lost the first claim's write (the old primary took
            # it before the sentinels demoted it). It runs once; its settle ends both.
            log.warning("request %s was dispatched again while it runs here; not restarted", rid)
            return
        self.running[rid] = _Running(rid, kv_tokens, tenant=tenant, tag=tag, claim=claim)
        if tracing.enabled():
            self.running[rid].popped_ns = time.time_ns()
        self._kv_reserved += kv_tokens
        if tenant:
            self._per_tenant[tenant] += 1
            self._kv_by_tenant[tenant] += kv_tokens
            self._set_pending(self.running[rid], kv_tokens)
        task = asyncio.create_task(self._serve(rid), name=f"serve-{rid}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _freed(self, rid: str) -> None:
        entry = self.running.pop(rid, None)
        if entry is not None:
            self._kv_reserved -= entry.kv_tokens
            if entry.tenant:
                self._set_pending(entry, 0)
                self._per_tenant[entry.tenant] -= 1
                self._kv_by_tenant[entry.tenant] -= entry.kv_tokens
                if not self._per_tenant[entry.tenant]:
                    del self._per_tenant[entry.tenant]
                    del self._kv_by_tenant[entry.tenant]
        assert self._slot_freed is not None
        self._slot_freed.set()
        self._wake_self()

    def _wake_soon(self) -> None:
        self._wake_self()

    def _set_pending(self, entry: _Running, tokens: int) -> None:
        """Its prompt tokens waiting for prefill, kept in the per-tenant sum (rule E)."""
        if not entry.tenant or entry.pending == tokens:
            return
        self._prefill_by_tenant[entry.tenant] += tokens - entry.pending
        entry.pending = tokens
        if not self._prefill_by_tenant[entry.tenant]:
            del self._prefill_by_tenant[entry.tenant]

    def _wake_self(self) -> None:
        """Let the dispatch loop look at the queue now (a slot freed, a prefill ended): an
        in-process signal, no Redis round trip; and only while the last dispatch left requests
        queued (``_queued``), as with none queued nothing here can change its answer. New work
        wakes the loop through the pool's wake list (_pool_wakes) instead. Each dispatch is a
        script of some 30 commands in Redis: this kept an idle pool's worker from running four
        of them per request, three of which found nothing (bench/ab.py's command breakdown)."""
        if self._work is not None and self._queued:
            self._work.set()

    # -- one request --------------------------------------------------------------------------

    async def _serve(self, rid: str) -> None:
        entry = self.running[rid]
        try:
            claim, entry.claim = entry.claim, None  # the payload is the engine's now
            payload = dict(claim.payload or {}) if claim is not None else {}
            if entry.popped_ns:
                self._trace_dispatch(entry, payload.get("trace"))
            entry.cancel_reason = entry.cancel_reason or (claim.cancel_reason if claim else "")
            if entry.cancel_reason:
                event = transport.finish_event(FinishReason.ABORT, usage_of(0, 0, 0))
                await self._settle(rid, Status.CANCELLED, FinishReason.ABORT, 0, 0, 0,
                                   error_code=entry.cancel_reason, event=event)
                return
            request = self._engine_request(rid, payload, entry.tag)
            if entry.pending:  # the prompt's real length, now that it is known
                self._set_pending(entry, len(request.prompt_token_ids))
            await self._generate(entry, request)
        except Exception:
            log.exception("serving %s failed", rid)
            await self._settle(rid, Status.ERROR, None, None, 0, None, error_code="worker_error",
                               event=transport.error_event("worker_error", "The worker failed.",
                                                           retryable=True))
        finally:
            self._freed(rid)

    def _trace_dispatch(self, entry: _Running, carried: bytes | None) -> None:
        """Join the gateway's trace: the queue wait (enqueue -> dispatch) and the hand-over."""
        found = tracing.from_carrier(carried)
        if found is None:
            return
        entry.trace, enqueued_ns = found
        where = {"pool": self.spec.name, "worker": self.worker_id, "tenant__id": entry.tenant}
        tracing.record(entry.trace, "queue_wait", enqueued_ns, entry.popped_ns, **where)
        tracing.record(entry.trace, "dispatch", entry.popped_ns, time.time_ns(), **where)

    def _trace_engine(self, entry: _Running, now_ns: int, status: str,
                      error_code: str | None, prompt: int | None, output: int | None) -> None:
        """The engine's prefill (hand-over -> first output) and decode (-> the end)."""
        if not entry.submitted_ns:
            return
        first = entry.first_ns or now_ns
        where = {"pool": self.spec.name, "worker": self.worker_id}
        tracing.record(entry.trace, "engine.prefill", entry.submitted_ns, first,
                       gen_ai__usage__input_tokens=prompt, **where)
        if entry.first_ns:
            tracing.record(entry.trace, "engine.decode", entry.first_ns, now_ns,
                           gen_ai__usage__output_tokens=output, status=status,
                           error=error_code if status != Status.OK else None, **where)

    def _engine_request(self, rid: str, payload: dict[str, bytes],
                        tag: float = 0.0) -> EngineRequest:
        return EngineRequest(
            request_id=rid, prompt_token_ids=unpack_prompt(payload["prompt_ids"]),
            sampling=unpack_sampling(payload["sampling"]),
            cache_salt=payload["salt"].decode() if payload["salt"] else "",
            # The request's own priority if it has one, else its WFQ finish tag: inside the
            # engine, prefill and admission then follow the dispatcher's fair order (a tenant
            # behind its share has the smaller tag), docs/adr/0017.
            priority=int(payload.get("priority") or 0) or int(tag),
            # The tenant's LoRA adapter, if the request named one; the engine loads it only for
            # a request carrying its owner's salt (serving.adapters).
            adapter=(payload.get("adapter") or b"").decode() or None,
        )

    def _on_delta(self, entry: _Running, delta: TokenDelta, choice: int | None = None) -> None:
        """One delta into this step's batch. Called synchronously, from inside the engine's
        step for engines that batch (``Engine.stream``): keep it cheap and never raise.

        ``choice`` is set for framed requests (see ``_run_choices``)."""
        if entry.trace is not None and not entry.first_ns:
            entry.first_ns = time.time_ns()
        if entry.pending:
            self._set_pending(entry, 0)  # first output: its prompt is prefilled
            if len(self.running) < self.spec.max_sequences:
                # Its tenant may have been held back by its prefill share (rule E) with slots
                # free: look at the queue now, not at the next wake-up timeout.
                self._wake_soon()
        if entry.invalid:
            return
        if entry.cancel_reason and delta.finish_reason is None:
            self._abort_soon(entry.rid)  # a cancel that came before the engine had it
        if not self._valid_ids(delta.token_ids):
            # Garbage from the engine fails this request only; what reached the client before
            # is billed (output None = the delivered count), nothing after (see _generate).
            # Cancelling the stream call is the abort, for every backend (Engine.stream).
            entry.invalid = True
            if entry.stream is not None:
                entry.stream.cancel()
            return
        if choice is not None:
            if not entry.broken:
                self._relay(entry, frame(choice, delta), len(delta.token_ids),
                            first=not entry.first_sent and bool(delta.token_ids))
                entry.first_sent = entry.first_sent or bool(delta.token_ids)
            return
        if (delta.token_ids or delta.text) and not entry.broken:
            self._relay(entry, delta.text, len(delta.token_ids), first=not entry.first_sent)
            entry.first_sent = True

    def _relay(self, entry: _Running, text: str, n: int, *, first: bool) -> None:
        """Add a delta to the next step batch."""
        if entry.rid not in self._batch.tokens:
            entry.entries += 1
        self._batch.add(entry.rid, text, n, before=entry.relayed, first=first,
                        index=entry.entries)
        entry.relayed += n
        self._flush_soon()

    async def _abort(self, rid: str) -> None:
        """Abort every engine sequence of a request (one per choice)."""
        entry = self.running.get(rid)
        if entry is not None and entry.embedding and entry.stream is not None:
            entry.stream.cancel()  # an embedding call is abandoned by cancelling it
            return
        for seq_id in (entry.choice_ids if entry is not None and entry.choice_ids else (rid,)):
            await self.engine.abort(seq_id)

    def _abort_soon(self, rid: str) -> None:
        task = asyncio.create_task(self._abort(rid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _run_choices(self, entry: _Running, request: EngineRequest) -> asyncio.Future[Any]:
        """Start one engine sequence per choice; the future resolves to their last deltas.

        Choice 0 runs under the request id with the request's own seed (so n=1 with logprobs
        samples exactly what a plain request does); choice i under ``rid.i`` with seed + i,
        or a fresh seed when none was given, so the choices differ.
        """
        sp = request.sampling
        requests = []
        for i in range(sp.n):
            seed = sp.seed if i == 0 else (
                sp.seed + i if sp.seed is not None else random.getrandbits(62))
            requests.append(replace(request, request_id=request.request_id if i == 0
                                    else f"{request.request_id}.{i}",
                                    sampling=replace(sp, n=1, seed=seed)))
        entry.choice_ids = tuple(r.request_id for r in requests)

        def one(i: int, req: EngineRequest) -> asyncio.Task[TokenDelta | None]:
            return asyncio.create_task(
                self.engine.stream(req, lambda d: self._on_delta(entry, d, i)))

        entry.choice_tasks = tuple(one(i, r) for i, r in enumerate(requests))
        return asyncio.gather(*entry.choice_tasks)

    async def _embed(self, entry: _Running, request: EngineRequest) -> None:
        """An embeddings request: one engine call for all its inputs, the vectors as one stream
        entry, settled for its prompt tokens (there is no output)."""
        rid, sp = entry.rid, request.sampling
        ids, prompts, start = request.prompt_token_ids, [], 0
        for length in sp.embed_segments:
            prompts.append(ids[start:start + length])
            start += length
        entry.embedding = True
        entry.stream = asyncio.ensure_future(self.engine.embed(rid, prompts, sp.dimensions))
        prompt = len(ids)
        try:
            vectors = await entry.stream
        except asyncio.CancelledError:
            if _cancelling():
                raise
            event = transport.finish_event(FinishReason.ABORT, usage_of(prompt, 0, 0))
            await self._settle(rid, Status.CANCELLED, FinishReason.ABORT, prompt, 0, 0,
                               error_code=entry.cancel_reason or "cancelled", event=event)
            return
        except EngineError as exc:
            if exc.refused:  # the request itself (a `dimensions` the model lacks): a 400
                await self._refused(rid, exc)
                return
            await self._settle(rid, Status.ERROR, FinishReason.ERROR, prompt, 0, 0,
                               error_code="engine_error",
                               event=transport.error_event("engine_error", str(exc),
                                                           retryable=exc.retryable))
            return
        if not entry.broken:
            self._relay(entry, pack_vectors(vectors), 0, first=True)
        await self._settle(rid, Status.OK, FinishReason.STOP, prompt, 0, 0, error_code=None,
                           event=transport.finish_event(FinishReason.STOP,
                                                        usage_of(prompt, 0, 0)))

    async def _generate(self, entry: _Running, request: EngineRequest) -> None:
        rid = entry.rid
        if request.sampling.embed_segments:
            await self._embed(entry, request)
            return
        if entry.trace is not None:
            entry.submitted_ns = time.time_ns()
        if framed(request):
            entry.stream = self._run_choices(entry, request)
        else:
            entry.stream = asyncio.ensure_future(
                self.engine.stream(request, lambda d: self._on_delta(entry, d)))
        try:
            try:
                last = await entry.stream
                if isinstance(last, list):
                    last = combine(last)
            except asyncio.CancelledError:
                if not entry.invalid or _cancelling():
                    raise
                last = None
            if entry.invalid:
                await self._settle(
                    rid, Status.ERROR, FinishReason.ERROR, None, 0, None,
                    error_code="engine_invalid_output",
                    event=transport.error_event(
                        "engine_invalid_output", "The model server returned invalid "
                        "output for this request; please retry.", retryable=True))
                return
        except EngineError as exc:
            if exc.refused and not entry.first_sent:
                await self._refused(rid, exc)
                return
            usage = getattr(exc, "usage", None)
            if len(entry.choice_tasks) > 1:
                # One choice failed: stop the others before settling, so nothing is written
                # after the final entry; bill what was delivered (usage None).
                await self._abort(rid)
                await asyncio.wait(entry.choice_tasks, timeout=10)
                usage = None
            if entry.cancel_reason:
                # The cancel was here first (a client gone, a deadline): the error came from
                # ending the sequence, or after, and nobody reads the stream now (I4).
                await self._settle_cancelled(
                    entry, usage.prompt_tokens if usage else None,
                    usage.cached_prompt_tokens if usage else 0,
                    usage.output_tokens if usage else None)
                return
            await self._settle(
                rid, Status.ERROR, FinishReason.ERROR,
                usage.prompt_tokens if usage else None, usage.cached_prompt_tokens if usage else 0,
                usage.output_tokens if usage else None, error_code="engine_error",
                event=transport.error_event("engine_error", str(exc), retryable=exc.retryable),
            )
            return
        if last is None and entry.cancel_reason:
            await self._settle_cancelled(entry, None, 0, None)  # billed for what was delivered
            return
        if last is None:  # the engine ended the stream without a finish (it was stopped)
            await self._settle(rid, Status.ERROR, None, None, 0, None, error_code="engine_stopped",
                               event=transport.error_event("engine_stopped", "The engine stopped.",
                                                           retryable=True))
            return
        await self._finish(entry, last)

    async def _refused(self, rid: str, exc: EngineError) -> None:
        """The engine turned the request down before any work: settled with nothing used, so
        nothing is charged, and the gateway answers 400 (``engine_refused``)."""
        await self._settle(rid, Status.ERROR, FinishReason.ERROR, 0, 0, 0,
                           error_code=REFUSED,
                           event=transport.error_event(REFUSED, str(exc), retryable=False,
                                                       param=exc.param))

    def _valid_ids(self, ids: list[int]) -> bool:
        if not ids:
            return True
        if self._vocab is None:
            self._vocab = self.engine.tokenizer.vocab_size
        return min(ids) >= 0 and max(ids) < self._vocab

    async def _finish(self, entry: _Running, last: TokenDelta) -> None:
        u = last.usage
        prompt, cached, out = (u.prompt_tokens, u.cached_prompt_tokens, u.output_tokens) if u \
            else (None, 0, None)
        event: Mapping[str, str | int]  # a finish event carries its usage, an error event not
        if entry.cancel_reason and (entry.broken or last.finish_reason == FinishReason.ABORT):
            # Cancelled (I4: the cancel's status, whatever else ended the sequence after it); a
            # broken stream is billed for what reached it (the delivered count), as below.
            await self._settle_cancelled(entry, prompt, cached, None if entry.broken else out)
            return
        if entry.broken:  # billed for what reached its stream (the delivered count)
            status, code, out = Status.ERROR, "stream_broken", None
            event = transport.error_event("stream_broken", "Part of the response was lost; "
                                          "please retry.", retryable=True)
        elif last.finish_reason != FinishReason.ABORT:
            status, code, event = Status.OK, None, transport.finish_event(
                last.finish_reason or "stop", usage_of(prompt or 0, out or 0, cached))
        elif entry.engine_failed:
            status, code = Status.ERROR, "engine_restart"
            event = transport.error_event("engine_restart", "The model server failed and is "
                                          "restarting; retry.", retryable=True)
        else:  # aborted by the drain timeout
            status, code = Status.ERROR, "worker_shutdown"
            event = transport.error_event("worker_shutdown", "The worker shut down; retry.",
                                          retryable=True)
        await self._settle(entry.rid, status, last.finish_reason, prompt, cached, out,
                           error_code=code, event=event)

    async def _settle_cancelled(self, entry: _Running, prompt: int | None, cached: int,
                                output: int | None) -> None:
        """A cancelled request (the worker saw its cancel): billed for the tokens generated,
        ``output`` None meaning the count delivered to its stream (I5)."""
        event = transport.finish_event(FinishReason.ABORT,
                                       usage_of(prompt or 0, output or 0, cached))
        await self._settle(entry.rid, Status.CANCELLED, FinishReason.ABORT, prompt, cached, output,
                           error_code=entry.cancel_reason, event=event)

    async def _settle(self, rid: str, status: str, finish_reason: str | None,
                      prompt: int | None, cached: int, output: int | None, *,
                      error_code: str | None, event: Mapping[str, str | int]) -> bool:
        """Queue the settle behind this request's last tokens, in the next step's pipeline."""
        entry = self.running.get(rid)
        traced, began = None, 0
        if entry is not None and entry.trace is not None:
            traced, began = entry.trace, time.time_ns()
            self._trace_engine(entry, began, status, error_code, prompt, output)
        keys, args = settlement.settle_call(
            self.spec.name, rid, status=status, finish_reason=finish_reason, prompt_tokens=prompt,
            cached_tokens=cached, output_tokens=output, error_code=error_code, event=event,
            inflight=self.inflight,
        )
        give_up, delay = time.monotonic() + SETTLE_RETRY_S, 0.1
        while True:
            try:
                reply = await self._settle_once(rid, keys, args)
                break
            except redis.RedisError as exc:
                if not is_outage(exc):
                    raise
                # Safe to repeat: settle applies once per request state, so a retry of a settle
                # whose reply was lost is refused (nothing is charged or recorded twice; that
                # request's WFQ correction is then skipped: a skew of one request).
                if time.monotonic() > give_up:
                    raise
                log.warning("settling %s met a Redis outage; retrying", rid)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        done = settlement.parse_settle(rid, reply)
        if done is not None:
            await self._release(done)
        if traced is not None:
            tracing.record(traced, "settlement", began, time.time_ns(), pool=self.spec.name,
                           status=status, error_code=error_code, settled=done is not None)
        return done is not None

    async def _release(self, done: settlement.Settled) -> None:
        """The tenant's give-back (release.lua, once by its token): in the next step batch's
        round trip, not one of its own (issue 30); a batch that fails leaves it to the token's
        expiry, as a failed release always did (admit.lua A5). Under Redis Cluster its keys
        are on another node than the batch's: sent alone."""
        if cluster_mode():
            await settlement.release_async(done, self._redis)
            return
        self._batch.release(done.release_keys, done.release_args)
        self._flush_soon()

    async def _settle_once(self, rid: str, keys: list[str], args: list[Any]) -> Any:
        assert self._loop is not None
        waiter = self._loop.create_future()
        self._batch.settle(rid, keys, args)
        self._waiters.append(waiter)
        self._flush_soon()
        return await waiter

    # -- the step batch -----------------------------------------------------------------------

    def _flush_soon(self) -> None:
        assert self._flush_needed is not None
        self._flush_needed.set()

    async def _flusher(self) -> None:
        assert self._flush_needed is not None and self._loop is not None
        last = -1e9  # loop time of the last batch sent
        while not _cancelling():
            await self._flush_needed.wait()
            self._flush_needed.clear()
            # Let every consumer woken by this engine step add its delta, and under load every
            # chunk that arrives before the gap since the last batch is over (FLUSH_GAP_S).
            await asyncio.sleep(max(0.0, last + self.flush_gap_s - self._loop.time()))
            last = self._loop.time()
            await self._flush_once()

    async def _flush_once(self) -> None:
        batch, waiters = self._batch, self._waiters
        self._batch, self._waiters = transport.StepBatch(pool=self.spec.name), []
        if not batch:
            return
        self.flushes += 1
        try:
            replies = await batch.flush(self._redis, transport.RUNNING_STREAM_TTL_S)
        except Exception as exc:
            log.exception("writing a step batch failed")
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(exc)
            self._break(batch.tokens)
            return
        for waiter, reply in zip(waiters, replies, strict=True):
            if waiter.done():
                continue
            if isinstance(reply, Exception):  # Redis refused this settle (the others count)
                waiter.set_exception(reply)
            else:
                waiter.set_result(reply)

    def _break(self, rids: Iterable[str]) -> None:
        """These requests' tokens were lost in a failed write: abort them (see _Running)."""
        for rid in rids:
            entry = self.running.get(rid)
            if entry is not None and not entry.broken:
                entry.broken = True
                # Its deltas already in the next batch would follow the hole in its stream
                # (their ids say so little: relay_step.lua R1 refuses only ids already passed).
                self._batch.tokens.pop(rid, None)
                self._abort_soon(rid)

    # -- cancel, heartbeats, janitor ----------------------------------------------------------

    async def _cancel_listener(self) -> None:
        while not _cancelling():
            pubsub = new_async_pubsub_client().pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(transport.cancel_channel(self.spec.name))
                async for message in pubsub.listen():
                    if _cancelling():
                        return
                    await self._on_cancel(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("cancel listener failed; resubscribing")
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _on_cancel(self, data: bytes | str) -> None:
        rid, _, reason = text(data).partition("\t")
        await self._cancel(rid, reason)

    async def _cancel(self, rid: str, reason: str) -> None:
        entry = self.running.get(rid)
        if entry is None:
            return  # another worker's request (every worker of the pool hears every cancel)
        entry.cancel_reason = entry.cancel_reason or reason or "cancelled"
        if entry.started:
            await self._abort(rid)

    async def _heartbeats(self) -> None:
        while not _cancelling():
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self._beat()
            except Exception:
                log.exception("heartbeat failed")

    async def _sweeps(self) -> None:
        while not _cancelling():
            await asyncio.sleep(RECONCILE_S)
            try:
                await self._sweep()
            except Exception:
                log.exception("in-flight sweep failed")

    async def _sweep(self) -> None:
        """One round trip: this worker's in-flight sets (I4) and its requests' cancel flags (I5).

        **Strays.** A dispatch whose reply was lost (the connection dropped after the script
        ran) leaves what it claimed in our in-flight set with nobody running it. A failover
        that loses writes (a forced failover: the old primary takes writes until the sentinels
        demote it, then drops them) brings back as running requests we settled. Neither has
        another owner: the janitor reaps only dead workers' sets. Under the dispatch lock no
        claim is on its way from Redis into self.running, so a member we do not run is a
        stray: it ends as worker_lost (retryable), billed for what its stream delivered.

        **Missed cancels.** A cancel reaches a worker by PUBLISH, which Redis delivers only to
        a subscriber connected at that moment: one sent while the listener reconnects (a
        network blip, a failover) would leave the sequence generating to its end, the tenant
        paying for it. The flag is written before the PUBLISH (cancel.lua C1), so reading it
        catches every cancel, at most RECONCILE_S late.
        """
        assert self._dispatching is not None
        keys = [self.inflight, *(inflight_key(self.spec.name, w) for w in self._past_ids)]
        async with self._dispatching:
            unflagged = [rid for rid, entry in self.running.items() if not entry.cancel_reason]
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.smembers(key)
            for rid in unflagged:
                pipe.hget(req_key(self.spec.name, rid), "cancel")
            found = await pipe.execute()
            sets, flags = found[:len(keys)], found[len(keys):]
            strays = [(key, text(m)) for key, members in zip(keys, sets, strict=True)
                      for m in members if text(m) not in self.running]
        for key, rid in strays:
            if await janitor.fail_lost_request_async(self._redis, self.spec.name, rid, key):
                log.warning("settled %s: in this worker's in-flight set, not running here", rid)
            await self._redis.srem(key, rid)  # settled now or before: not in flight here
        self._past_ids = [w for w, members in zip(self._past_ids, sets[1:], strict=True)
                          if members]
        for rid, reason in zip(unflagged, flags, strict=True):
            if reason:
                log.warning("cancel of %s read from its flag: its message was missed", rid)
                await self._cancel(rid, text(reason))

    async def _beat(self) -> None:
        load = self.engine.load()
        failed = self.engine_failure is not None
        fields = {
            "pool": self.spec.name, "running": load.running, "waiting": load.waiting,
            # No capacity while the engine is down: the gateway routes to other pools.
            "max_running": 0 if failed else load.max_running,
            "kv_tokens_used": load.kv_tokens_used,
            "kv_tokens_total": load.kv_tokens_total, "kv_tokens_reserved": self._reserved_kv(),
            "in_flight": len(self.running), "draining": int(self._draining),
            # The context window this engine was built with: the gateway sizes requests by
            # the smallest its live workers advertise, not by the database's current value,
            # which may have changed since they started (gateway.inference.pools).
            "max_model_len": self.spec.max_model_len,
            "healthy": int(not failed), "engine_failure": self.engine_failure or "",
            "engine_restarts": self.engine_restarts,
        }
        args: list[Any] = [self.worker_id, self.spec.name, max(10, int(self.dead_after_s * 3))]
        for name, value in fields.items():
            args += [name, value]
        keys = [workers_key(self.spec.name), worker_key(self.spec.name, self.worker_id, "reaped"),
                worker_key(self.spec.name, self.worker_id, "load")]
        await self._redis.sadd(pools_key(), self.spec.name)  # the janitor walks the pools
        await quietlog.aflush(self._redis)  # repeated warnings' counts reach /metrics
        if not await script("heartbeat").run_async(self._redis, keys, args):
            await self._rejoin()

    async def _rejoin(self) -> None:
        """The janitor declared this worker dead (it missed heartbeats) and settled its requests.

        Abort them here too (their settle calls will find them settled) and come back under a
        new id: a reaped id never returns (heartbeat.lua), so nothing is settled twice.
        """
        old = self.worker_id
        self._past_ids.append(old)
        self.worker_id = new_worker_id(self.spec.name)
        log.error("worker %s was declared dead; aborting its requests, rejoining as %s",
                  old, self.worker_id)
        for rid, entry in list(self.running.items()):
            entry.reaped = True
            await self._abort(rid)
        await self._beat()

    # -- engine failure -------------------------------------------------------------------------

    async def _engine_watchdog(self) -> None:
        while not _cancelling():
            await asyncio.sleep(ENGINE_CHECK_S)
            why = self.engine.failure()
            if why is not None and not self._draining:
                await self._recover(why)

    async def _recover(self, why: str) -> None:
        """The engine died: stop taking work, end its requests retryably, start it again."""
        assert self._engine_ok is not None and self._stop is not None
        self._engine_ok.clear()
        self.engine_failure = why
        log.error("engine of pool %s failed (%s): %d running requests end retryably",
                  self.spec.name, why, len(self.running))
        with contextlib.suppress(Exception):
            await self._beat()  # unhealthy, no capacity: routed elsewhere from now on
        for rid, entry in list(self.running.items()):
            entry.engine_failed = True
            if entry.started:
                await self._abort(rid)  # every choice of an n > 1 request
        await self._until(lambda: not self.running, timeout=30.0)
        if self.engine_restarts >= self.max_engine_restarts:
            self._give_up(EngineError(f"the engine failed ({why}) after "
                                      f"{self.engine_restarts} restarts"))
            return
        self.engine_restarts += 1
        try:
            with contextlib.suppress(Exception):
                await self.engine.stop()
            await self.engine.start()
        except Exception as exc:
            log.exception("restarting the engine of pool %s failed", self.spec.name)
            self._give_up(exc)
            return
        log.warning("engine of pool %s restarted (%d so far)", self.spec.name,
                    self.engine_restarts)
        self.engine_failure = None
        self._engine_ok.set()
        with contextlib.suppress(Exception):
            await self._beat()

    def _give_up(self, exc: BaseException) -> None:
        """Leave the pool (run()'s drain) and let the worker process exit to be replaced."""
        assert self._stop is not None
        self.fatal = exc
        self._stop.set()

    async def _until(self, check: Callable[[], bool], timeout: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout
        while not check():
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def _janitor(self) -> None:
        interval = max(self.heartbeat_s, self.dead_after_s / 4)
        while not _cancelling():
            await asyncio.sleep(interval)
            try:
                await asyncio.to_thread(janitor.sweep)
            except Exception:
                log.exception("janitor sweep failed")


def pack_vectors(vectors: list[list[float]]) -> str:
    """Embedding vectors for the stream: {"d": width, "v": base64 of little-endian float32}."""
    from array import array

    flat = array("f", [x for vec in vectors for x in vec])
    width = len(vectors[0]) if vectors else 0
    return json.dumps({"d": width, "v": base64.b64encode(flat.tobytes()).decode()})


def framed(request: EngineRequest) -> bool:
    """Whether the request's stream carries framed per-choice pieces instead of plain text."""
    sp = request.sampling
    return sp.n > 1 or sp.logprobs is not None


def frame(choice: int, delta: TokenDelta) -> str:
    """One choice's delta as a JSON line: {"i": choice, "t": text, "lp": [...], "f": reason}.

    ``lp`` holds [token id, logprob, [[id, logprob], ...]] per token; the gateway renders
    tokens with the same tokenizer. JSON never contains a raw newline, so pieces the step
    batch joins split again on "\n".
    """
    piece: dict[str, Any] = {"i": choice}
    if delta.text:
        piece["t"] = delta.text
    if delta.logprobs:
        piece["lp"] = [[lp.token_id, lp.logprob, [list(t) for t in lp.top]]
                       for lp in delta.logprobs]
    if delta.finish_reason is not None:
        piece["f"] = delta.finish_reason
    return json.dumps(piece, separators=(",", ":")) + "\n"


def combine(lasts: list[TokenDelta | None]) -> TokenDelta | None:
    """The last deltas of n choices as one: the prompt once, output tokens summed (I2)."""
    if any(last is None for last in lasts):
        return None
    done = [last for last in lasts if last is not None]
    reasons = [d.finish_reason for d in done]
    reason = FinishReason.ABORT if FinishReason.ABORT in reasons else reasons[0]
    usages = [d.usage for d in done]
    if any(u is None for u in usages):
        return TokenDelta([], "", reason, None)
    first = usages[0]
    assert first is not None
    out = sum(u.output_tokens for u in usages if u is not None)
    return TokenDelta([], "", reason, Usage(first.prompt_tokens, first.cached_prompt_tokens, out))


def _cancelling() -> bool:
    """True once this task was cancelled, even if a library swallowed the CancelledError
    (redis-py can, mid-read); background loops test it so a drain never hangs on them."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


# -- Celery integration -----------------------------------------------------------------------


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed (it comes with uvicorn[standard]), as the gateway runs on: the
    host's per-step work is callbacks and socket writes, which uvloop does at half the cost."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class HostThread:
    """Runs an EngineHost on its own event loop in a daemon thread."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="engine-host", daemon=True)

    def _main(self) -> None:
        try:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(self.host.run())
        except BaseException as exc:  # reported to the starter, which fails the worker
            self.error = exc
            log.exception("engine host stopped with an error")
        finally:
            started = self.host.ready.is_set()
            self.host.ready.set()
        if started and self.host.fatal is not None:
            # The engine cannot be revived; the host has left the pool and its requests are
            # settled. Exit non-zero so the supervisor (systemd, Kubernetes) replaces us.
            log.critical("engine host gave up: %s; exiting with status %d", self.host.fatal,
                         ENGINE_FAILED_EXIT)
            logging.shutdown()
            os._exit(ENGINE_FAILED_EXIT)

    def start(self, timeout: float | None = None) -> None:
        # Loading a real model takes minutes; the other backends start in seconds.
        timeout = timeout or START_TIMEOUT_S.get(self.host.spec.backend, 60.0)
        self.thread.start()
        if not self.host.ready.wait(timeout):
            raise EngineConfigError("the engine host did not start in time")
        if self.error is not None:
            raise EngineConfigError(f"the engine host failed to start: {self.error}")

    def stop(self, timeout: float | None = None) -> None:
        self.host.request_stop()
        self.thread.join(timeout)


class EngineHostStep(bootsteps.StartStopStep):
    """Hosts the pool's engine in this worker when ``--engine-pool`` is given.

    ``gateway.celery`` adds it to the worker by name, with the two options, so the Celery app
    loads without this module: it imports models, which wait for Django's set-up.
    """

    def __init__(self, parent: Any, engine_pool: str | None = None,
                 engine_worker_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.pool_name = engine_pool
        self.worker_id = engine_worker_id
        self.runner: HostThread | None = None

    def include_if(self, parent: Any) -> bool:
        return bool(self.pool_name)

    def start(self, parent: Any) -> None:
        assert self.pool_name
        spec = EngineSpec.load(self.pool_name)
        tracing.setup("inference-gateway-worker")  # only if OTEL_* asks for it
        host = EngineHost(spec, build_engine(spec), self.worker_id)
        self.runner = HostThread(host)
        self.runner.start()
        # Celery stops its broker consumer before calling stop() here, which can take a
        # second; begin the drain the moment shutdown starts, so no new work is taken.
        worker_shutting_down.connect(self._begin_drain, weak=False)

    def _begin_drain(self, **_: Any) -> None:
        if self.runner is not None:
            self.runner.host.request_stop()

    def stop(self, parent: Any) -> None:
        if self.runner is not None:
            self.runner.stop(self.runner.host.drain_timeout_s + 30)
            self.runner = None
        tracing.shutdown()  # the last spans go out before the process ends

    def shutdown(self, parent: Any) -> None:
        self.stop(parent)


__all__ = ["EngineConfigError", "EngineHost", "EngineHostStep", "EngineSpec", "build_engine"]
