"""The engine host: one engine per Celery worker process, fed by the WFQ dispatcher.

``celery -A gateway worker --engine-pool NAME`` adds ``EngineHostStep`` to the worker. It builds
the pool's engine from its ``Pool`` row (``workers.engine.registry.build_engine``: a bad backend
or setting fails the worker's start with a message naming the pool) and runs, on an asyncio
loop in its own thread:

- the dispatch loop: pulls the next request from the pool's WFQ only while the engine has a
  free slot and KV room (``wfq.dispatch_many`` moves it atomically into this worker's in-flight
  set), and otherwise waits in ``BLPOP`` on the pool's wake list (pushed by every enqueue) and
  this worker's own (pushed when a slot frees), so it wakes at once without busy-polling;
- one consumer task per running request, pumping engine deltas into the step batch; the
  flusher writes each step's batch in one pipeline (``transport.StepBatch``), and a request's
  settlement (with the engine's own usage) rides in the same pipeline after its last tokens;
- the cancel subscriber (``cancel:{pool}``): aborts the engine sequence within one step;
- heartbeats (``workers:{pool}``, every ``WORKER_HEARTBEAT_SECONDS``) with load and capacity;
- the janitor (``serving.janitor``), as in every worker.

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
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis
from celery import bootsteps
from celery.signals import worker_shutting_down
from django.conf import settings

from infra.redis_conn import get_async_redis, key
from serving import admission, janitor, settlement, transport
from serving.keys import inflight_key
from serving.lua import script
from serving.settlement import Status
from serving.wfq import AsyncWfq
from serving.wire import unpack_prompt, unpack_sampling, usage_of
from workers.engine.base import Engine, EngineError, EngineRequest, FinishReason, TokenDelta
from workers.engine.registry import EngineConfigError, EngineSpec, build_engine

log = logging.getLogger(__name__)

WAKE_TIMEOUT_S = 0.25  # an idle worker re-checks its queue at least this often
# A settle that meets a Redis outage is retried this long: a Sentinel failover takes seconds, and
# a request's state survives it on the promoted replica, so without the retry its stream would
# wait for a terminal event until the deadline sweep. Past this, the janitor's sweeps end it.
SETTLE_RETRY_S = 30.0


def new_worker_id(pool: str) -> str:
    return f"{pool}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class _Running:
    rid: str
    kv_tokens: int
    tenant: str = ""  # for the dispatcher's slot fairness (per-tenant running counts)
    cancel_reason: str = ""
    reaped: bool = False  # the janitor settled it already (this worker was declared dead)
    # A step batch with its tokens could not be written (Redis down or restarted): the stream
    # has a hole, so the request is aborted and ends with a retryable error; nothing more is
    # written to its stream (after a restart that would recreate keys without a TTL).
    broken: bool = False
    first_sent: bool = False  # its first tokens are in a step batch (stamps first_token_at)
    invalid: bool = False  # the engine sent ids outside the vocabulary: aborted, fails
    stream: asyncio.Future[TokenDelta | None] | None = None  # the engine.stream() call

    @property
    def started(self) -> bool:
        """The sequence was submitted to the engine."""
        return self.stream is not None


class EngineHost:
    """Runs one engine for one pool on the current event loop (see the module docstring)."""

    def __init__(self, spec: EngineSpec, engine: Engine, worker_id: str | None = None, *,
                 heartbeat_s: float | None = None, dead_after_s: float | None = None,
                 drain_timeout_s: float | None = None) -> None:
        self.spec = spec
        self.engine = engine
        self.worker_id = worker_id or new_worker_id(spec.name)
        self.heartbeat_s = heartbeat_s or settings.WORKER_HEARTBEAT_SECONDS
        self.dead_after_s = dead_after_s or settings.WORKER_DEAD_AFTER_SECONDS
        self.drain_timeout_s = (settings.WORKER_DRAIN_SECONDS if drain_timeout_s is None
                                else drain_timeout_s)
        self.running: dict[str, _Running] = {}
        # Derived from running, kept as it changes (_start, _freed) rather than recounted on
        # every dispatch: this worker's sequences per tenant (slot fairness) and reserved KV.
        self._per_tenant: Counter[str] = Counter()
        self._kv_reserved = 0
        self.ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._batch = transport.StepBatch()
        self._waiters: list[asyncio.Future[Any]] = []
        self._flush_needed: asyncio.Event | None = None
        self._slot_freed: asyncio.Event | None = None
        self._redis: Any = None
        self._wfq: Any = None
        self._vocab: int | None = None  # the engine tokenizer's vocabulary size, read once

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def inflight(self) -> str:
        return inflight_key(self.worker_id)

    def _self_wake(self) -> str:
        return key("wake", "worker", self.worker_id)

    def request_stop(self) -> None:
        """Thread-safe: begin the drain."""
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended: nothing to stop
                self._loop.call_soon_threadsafe(self._stop.set)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop, self._flush_needed = asyncio.Event(), asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._redis = get_async_redis()
        self._wfq = AsyncWfq(self._redis)
        await self.engine.start()
        await self._beat()  # registered before taking work, so a janitor can see us
        background = [self._flusher(), self._cancel_listener(), self._heartbeats(),
                      self._janitor()]
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
            await self.engine.stop()
            await script("leave").run_async(self._redis, self._worker_keys(), [self.worker_id])
            await self._redis.delete(self._self_wake())
            log.info("engine host %s drained and left pool %s", self.worker_id, self.spec.name)

    async def _drain(self, dispatch: asyncio.Task[None]) -> None:
        self._draining = True
        assert self._slot_freed is not None
        self._slot_freed.set()  # a dispatch loop waiting for a free slot sees the drain
        await self._wake_self("stop")
        await asyncio.gather(dispatch, return_exceptions=True)
        if self._tasks:
            log.info("draining %d running sequences", len(self._tasks))
            _, pending = await asyncio.wait(self._tasks, timeout=self.drain_timeout_s)
            if pending:
                for rid in list(self.running):
                    await self.engine.abort(rid)
                await asyncio.wait(pending, timeout=10)
        await self._flush_once()

    def _worker_keys(self) -> list[str]:
        return [key("workers", self.spec.name), self.inflight,
                key("worker", self.worker_id, "load")]

    # -- dispatch -----------------------------------------------------------------------------

    def _reserved_kv(self) -> int:
        return self._kv_reserved

    async def _dispatch_loop(self) -> None:
        assert self._slot_freed is not None
        while not self._draining:
            free_slots = self.spec.max_sequences - len(self.running)
            if free_slots <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                items = await self._wfq.dispatch_many(
                    self.spec.name, n=free_slots, free_slots=free_slots,
                    free_kv_tokens=max(0, self.spec.kv_cache_tokens - self._reserved_kv()),
                    overcommit=self.spec.kv_overcommit, worker_id=self.worker_id,
                    # This worker's own sequences per tenant: the dispatcher caps a tenant at its
                    # weighted share of our slots while others are active (ADR 0006). Ours, so
                    # no shared counter can be left wrong by an exit path.
                    running=self._per_tenant,
                )
            except Exception:
                log.exception("dispatch failed")
                await asyncio.sleep(WAKE_TIMEOUT_S)
                continue
            for item in items:
                self._start(item.request_id, item.kv_tokens, item.tenant_id)
            if not items:
                await self._wait_for_work()

    async def _wait_for_work(self) -> None:
        # Blocks on a pool-wide list (new work) and this worker's own (a slot freed, or stop).
        try:
            await self._redis.blpop([transport.wake_key(self.spec.name), self._self_wake()],
                                    timeout=WAKE_TIMEOUT_S)
        except Exception:
            log.exception("waiting for work failed")
            await asyncio.sleep(WAKE_TIMEOUT_S)

    def _start(self, rid: str, kv_tokens: int, tenant: str = "") -> None:
        self.running[rid] = _Running(rid, kv_tokens, tenant=tenant)
        self._kv_reserved += kv_tokens
        if tenant:
            self._per_tenant[tenant] += 1
        task = asyncio.create_task(self._serve(rid), name=f"serve-{rid}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _freed(self, rid: str) -> None:
        entry = self.running.pop(rid, None)
        if entry is not None:
            self._kv_reserved -= entry.kv_tokens
            if entry.tenant:
                self._per_tenant[entry.tenant] -= 1
                if not self._per_tenant[entry.tenant]:
                    del self._per_tenant[entry.tenant]
        assert self._slot_freed is not None
        self._slot_freed.set()
        task = asyncio.create_task(self._wake_self("slot"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wake_self(self, why: str) -> None:
        """Return the dispatch loop from BLPOP now; capped so unread wakes never pile up."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.lpush(self._self_wake(), why)
        pipe.ltrim(self._self_wake(), 0, 1)
        await pipe.execute()

    # -- one request --------------------------------------------------------------------------

    async def _serve(self, rid: str) -> None:
        entry = self.running[rid]
        try:
            claim = await admission.claim_async(rid, self.worker_id, client=self._redis)
            if claim is None:  # settled while it was being dispatched (cancel, deadline)
                await self._redis.srem(self.inflight, rid)
                return
            entry.cancel_reason = entry.cancel_reason or claim.cancel_reason
            if entry.cancel_reason:
                event = transport.finish_event(FinishReason.ABORT, usage_of(0, 0, 0))
                await self._settle(rid, Status.CANCELLED, FinishReason.ABORT, 0, 0, 0,
                                   error_code=entry.cancel_reason, event=event)
                return
            await self._generate(entry, self._engine_request(rid, claim.payload))
        except Exception:
            log.exception("serving %s failed", rid)
            await self._settle(rid, Status.ERROR, None, None, 0, None, error_code="worker_error",
                               event=transport.error_event("worker_error", "The worker failed.",
                                                           retryable=True))
        finally:
            self._freed(rid)

    def _engine_request(self, rid: str, payload: dict[str, bytes]) -> EngineRequest:
        return EngineRequest(
            request_id=rid, prompt_token_ids=unpack_prompt(payload["prompt_ids"]),
            sampling=unpack_sampling(payload["sampling"]),
            cache_salt=payload["salt"].decode() if payload["salt"] else "",
            priority=int(payload.get("priority") or 0),
            # The tenant's LoRA adapter, if the request named one; the engine loads it only for
            # a request carrying its owner's salt (workers.engine.adapters).
            adapter=(payload.get("adapter") or b"").decode() or None,
        )

    def _on_delta(self, entry: _Running, delta: TokenDelta) -> None:
        """One delta into this step's batch. Called synchronously, from inside the engine's
        step for engines that batch (``Engine.stream``): keep it cheap and never raise."""
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
        if (delta.token_ids or delta.text) and not entry.broken:
            self._batch.add(entry.rid, delta.text, len(delta.token_ids),
                            first=not entry.first_sent)
            entry.first_sent = True
            self._flush_soon()

    def _abort_soon(self, rid: str) -> None:
        task = asyncio.create_task(self.engine.abort(rid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _generate(self, entry: _Running, request: EngineRequest) -> None:
        rid = entry.rid
        entry.stream = asyncio.ensure_future(
            self.engine.stream(request, lambda d: self._on_delta(entry, d)))
        try:
            try:
                last = await entry.stream
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
            usage = getattr(exc, "usage", None)
            await self._settle(
                rid, Status.ERROR, FinishReason.ERROR,
                usage.prompt_tokens if usage else None, usage.cached_prompt_tokens if usage else 0,
                usage.output_tokens if usage else None, error_code="engine_error",
                event=transport.error_event("engine_error", str(exc), retryable=exc.retryable),
            )
            return
        if last is None:  # the engine ended the stream without a finish (it was stopped)
            await self._settle(rid, Status.ERROR, None, None, 0, None, error_code="engine_stopped",
                               event=transport.error_event("engine_stopped", "The engine stopped.",
                                                           retryable=True))
            return
        await self._finish(entry, last)

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
        if entry.broken:  # billed for what reached its stream (the delivered count)
            status, code, out = Status.ERROR, "stream_broken", None
            event = transport.error_event("stream_broken", "Part of the response was lost; "
                                          "please retry.", retryable=True)
        elif last.finish_reason != FinishReason.ABORT:
            status, code, event = Status.OK, None, transport.finish_event(
                last.finish_reason or "stop", usage_of(prompt or 0, out or 0, cached))
        elif entry.cancel_reason:
            status, code = Status.CANCELLED, entry.cancel_reason
            event = transport.finish_event(FinishReason.ABORT,
                                           usage_of(prompt or 0, out or 0, cached))
        else:  # aborted by the drain timeout
            status, code = Status.ERROR, "worker_shutdown"
            event = transport.error_event("worker_shutdown", "The worker shut down; retry.",
                                          retryable=True)
        await self._settle(entry.rid, status, last.finish_reason, prompt, cached, out,
                           error_code=code, event=event)

    async def _settle(self, rid: str, status: str, finish_reason: str | None,
                      prompt: int | None, cached: int, output: int | None, *,
                      error_code: str | None, event: dict[str, Any]) -> bool:
        """Queue the settle behind this request's last tokens, in the next step's pipeline."""
        keys, args = settlement.settle_call(
            rid, status=status, finish_reason=finish_reason, prompt_tokens=prompt,
            cached_tokens=cached, output_tokens=output, error_code=error_code, event=event,
            inflight=self.inflight,
        )
        give_up, delay = time.monotonic() + SETTLE_RETRY_S, 0.1
        while True:
            try:
                reply = await self._settle_once(rid, keys, args)
                break
            except (redis.ConnectionError, redis.TimeoutError):
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
            await settlement.correct_wfq_async(done)
        return done is not None

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
        assert self._flush_needed is not None
        while not _cancelling():
            await self._flush_needed.wait()
            self._flush_needed.clear()
            await asyncio.sleep(0)  # let every consumer woken by this engine step add its delta
            await self._flush_once()

    async def _flush_once(self) -> None:
        batch, waiters = self._batch, self._waiters
        self._batch, self._waiters = transport.StepBatch(), []
        if not batch:
            return
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
                self._abort_soon(rid)

    # -- cancel, heartbeats, janitor ----------------------------------------------------------

    async def _cancel_listener(self) -> None:
        while not _cancelling():
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
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
        text = data.decode() if isinstance(data, bytes) else data
        rid, _, reason = text.partition("\t")
        entry = self.running.get(rid)
        if entry is None:
            return  # another worker's request (every worker of the pool hears every cancel)
        entry.cancel_reason = entry.cancel_reason or reason or "cancelled"
        if entry.started:
            await self.engine.abort(rid)

    async def _heartbeats(self) -> None:
        while not _cancelling():
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self._beat()
            except Exception:
                log.exception("heartbeat failed")

    async def _beat(self) -> None:
        load = self.engine.load()
        fields = {
            "pool": self.spec.name, "running": load.running, "waiting": load.waiting,
            "max_running": load.max_running, "kv_tokens_used": load.kv_tokens_used,
            "kv_tokens_total": load.kv_tokens_total, "kv_tokens_reserved": self._reserved_kv(),
            "in_flight": len(self.running), "draining": int(self._draining),
        }
        args: list[Any] = [self.worker_id, self.spec.name, max(10, int(self.dead_after_s * 3))]
        for name, value in fields.items():
            args += [name, value]
        keys = [key("workers", self.spec.name), key("pools"),
                key("worker", self.worker_id, "reaped"), key("worker", self.worker_id, "load")]
        if not await script("heartbeat").run_async(self._redis, keys, args):
            await self._rejoin()

    async def _rejoin(self) -> None:
        """The janitor declared this worker dead (it missed heartbeats) and settled its requests.

        Abort them here too (their settle calls will find them settled) and come back under a
        new id: a reaped id never returns (heartbeat.lua), so nothing is settled twice.
        """
        old = self.worker_id
        self.worker_id = new_worker_id(self.spec.name)
        log.error("worker %s was declared dead; aborting its requests, rejoining as %s",
                  old, self.worker_id)
        for rid, entry in list(self.running.items()):
            entry.reaped = True
            await self.engine.abort(rid)
        await self._beat()

    async def _janitor(self) -> None:
        interval = max(self.heartbeat_s, self.dead_after_s / 4)
        while not _cancelling():
            await asyncio.sleep(interval)
            try:
                await asyncio.to_thread(janitor.sweep)
            except Exception:
                log.exception("janitor sweep failed")


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
            self.host.ready.set()

    def start(self, timeout: float = 60.0) -> None:
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

    def shutdown(self, parent: Any) -> None:
        self.stop(parent)


__all__ = ["EngineConfigError", "EngineHost", "EngineHostStep", "EngineSpec", "build_engine"]
