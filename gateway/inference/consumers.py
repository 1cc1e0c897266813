"""The OpenAI-compatible endpoints, as Channels consumers served by uvicorn.

One request, in the order the design sets (nothing is charged until ``submit``):
authenticate -> parse -> route to a pool -> tokenize -> size against the limits ->
shed if overloaded (503) -> (idempotency) -> submit (charge, or 429) -> stream or collect.

Disconnects. Channels' own ``AsyncHttpConsumer`` dispatches one message at a time, so while
``handle`` awaits tokens it cannot see ``http.disconnect``. ``__call__`` here reads the body
itself, then runs the handler and a disconnect watcher side by side: a client that goes away
while we wait for its first token is noticed at once and its submission cancelled, which the
engine honours within one step (I5). Writes after a disconnect are dropped, never raised.

Streams delay their response headers until the first event (or the first keep-alive tick), so a
request that fails before any token still gets a real 503 + Retry-After that the official
client retries, rather than a 200 followed by an error event.

Resume. Every token event's SSE id is ``<request id>/<stream entry id>``. A request carrying
``Last-Event-ID`` re-attaches to that request (same tenant only) and replays its stream after
that entry, for as long as the stream is kept (``serving.settlement.STREAM_TTL_AFTER_END``
after the end). A disconnect cancels the generation, so a resumed stream ends where generation
stopped; resuming a finished stream replays the rest of it, [DONE] included.

Settings: ``SSE_KEEPALIVE_SECONDS`` (15), ``METRICS_TOKEN`` (empty: /metrics open to loopback
clients only).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis
from channels.generic.http import AsyncHttpConsumer
from django.conf import settings
from opentelemetry.trace import Span, Status, StatusCode

from gateway import shutdown
from gateway.contentlog.store import aenqueue_content
from gateway.inference import (
    cache,
    cells,
    embeddings,
    idempotency,
    overload,
    oversize,
    revocation,
    sse,
)
from gateway.inference.bodies import (
    ChunkTemplate,
    UsageCounts,
    choices_body,
    completion_body,
    dumps,
    model_entries,
    usage_counts,
)
from gateway.inference.bodylimit import read_bounded_body
from gateway.inference.choices import (
    Assembler,
    check_resume_shape,
    framed,
    needs_assembler,
    stream_shape,
)
from gateway.inference.errors import (
    ApiError,
    method_not_allowed,
    model_not_found,
    rate_limited,
    server_error,
    unavailable,
)
from gateway.inference.failover import Failover
from gateway.inference.pools import PoolInfo, choose_pool, serving_model, visible_models
from gateway.inference.requests import (
    InferenceRequest,
    Kind,
    load_json_object,
    parse_object,
)
from gateway.inference.responses_api import (
    ResponseBuilder,
    dumps_events,
    responses_param,
    to_chat,
)
from gateway.inference.routes import Router, Target, targets_for
from gateway.inference.sampling import check_supported, sampling_params
from gateway.inference.sizing import size_request, tokenize
from gateway.inference.submit import submit_request
from gateway.inference.toolparsers import get_parser
from gateway.orm import in_thread
from infra import clientaddr, tracing
from infra.redis_conn import get_async_redis
from metering import metrics, overhead, requestlog
from serving.submission import (
    ErrorEvent,
    Event,
    FinishEvent,
    Rejection,
    Submission,
    TokenEvent,
    UsageInfo,
    attach,
)
from serving.tokenization import load_tokenizer
from serving.wire import SamplingParams
from tenants.auth import AuthError, Principal, aauthenticate_scope_request
from tenants.budgets import end_user_of

log = logging.getLogger(__name__)

CANCEL_GRACE_S = 2.0  # how long a cancelled handler may take to settle before it is torn down
JSON = (b"content-type", b"application/json")
OVERHEAD_HEADER = b"x-gateway-overhead-ms"
TRACE_HEADER = b"x-trace-id"  # the request's trace (infra.tracing), when tracing is on

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


# channels ships no type information: its consumer base class is Any to mypy.
class ApiConsumer(AsyncHttpConsumer):  # type: ignore[misc]
    """Body reading, disconnect watching and error answers shared by every endpoint."""

    methods: tuple[str, ...] = ("POST",)
    # The task ending the response when this process shuts down (set by ``_stop_soon``, from
    # the shutdown hook). A class default, not set in __call__: as_asgi() makes an instance
    # per request, and mypy would otherwise take it for None after __call__ assigned it.
    _stopping: asyncio.Task[None] | None = None

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        self.scope = scope
        self.base_send = send
        self.request_id = new_request_id()
        self.disconnected = asyncio.Event()
        self.started = False  # response headers sent
        self.finished = False  # last body part sent
        self._write_lock = asyncio.Lock()
        self.began = time.perf_counter()
        self.waited = 0.0  # seconds spent awaiting the worker's events (metering.overhead)
        self.span: Span | None = None  # the request's trace span, while tracing is on
        self.status = 0
        self.usage_seen: UsageInfo | None = None
        try:
            body = await self._read_body(receive)
        except ApiError as err:
            await self.send_error(err)
            return
        if body is None:
            return  # gone before it finished sending
        self.began = time.perf_counter()  # the client's upload is not the gateway's time
        handler = asyncio.create_task(self._run(body))
        watcher = asyncio.create_task(self._watch(receive))
        hook = functools.partial(self._stop_soon, handler)
        shutdown.subscribe(hook)
        try:
            await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not handler.done() and self._stopping is None:
                await self._client_gone(handler)
        finally:
            shutdown.unsubscribe(hook)
        if self._stopping is not None:
            await self._stopping  # the cancel reaches Redis before uvicorn finishes shutting down
        watcher.cancel()

    async def _read_body(self, receive: Receive) -> bytes | None:
        if self.scope["method"] not in self.methods:
            raise method_not_allowed(", ".join(self.methods))
        # At most MAX_REQUEST_BYTES (413) within BODY_READ_TIMEOUT_S (408): bodylimit.
        return await read_bounded_body(self.scope, receive)

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _client_gone(self, handler: asyncio.Task[None]) -> None:
        # uvicorn also reports http.disconnect once a response is complete: not a cancel then.
        gone_early = not self.finished
        self.disconnected.set()
        try:
            if gone_early:
                await self.on_disconnect()
        except Exception:
            log.exception("disconnect handling failed for %s", self.request_id)
        try:
            if getattr(self, "finish_detached", False):
                await asyncio.shield(handler)  # ends by the request's own total deadline
            else:
                await asyncio.wait_for(asyncio.shield(handler), CANCEL_GRACE_S)
        except TimeoutError:
            handler.cancel()
        except Exception:
            pass  # already logged by _run

    async def on_disconnect(self) -> None:
        """Called once when the client goes away before the response is complete."""

    def _stop_soon(self, handler: asyncio.Task[None]) -> None:
        self._stopping = asyncio.get_running_loop().create_task(self._server_stopping(handler))

    async def _server_stopping(self, handler: asyncio.Task[None]) -> None:
        """This process is shutting down: end the response now, retryable, and cancel the work.

        A 503 with Retry-After if nothing was sent yet (the official client retries it), else a
        last error event; then the request is cancelled like a disconnect, so the worker frees
        its slot and settles it for the tokens delivered.
        """
        await self.send_error(unavailable(
            "The server is shutting down; retry the request.", retry_after=1,
            code="server_shutdown"))
        self.disconnected.set()  # nothing more is written
        try:
            self.finish_detached = False  # an idempotent retry cannot wait for this process
            await self.on_disconnect()
        except Exception:
            log.exception("cancelling %s at shutdown failed", self.request_id)
        try:
            await asyncio.wait_for(asyncio.shield(handler), CANCEL_GRACE_S)
        except TimeoutError:
            handler.cancel()
        except Exception:
            pass  # already logged by _run

    async def _run(self, body: bytes) -> None:
        self.span = tracing.start_request(f"{self.scope['method']} {self.scope['path']}",
                                          self.scope.get("headers", ()))
        try:
            await self._handle(body)
        finally:
            pool = getattr(self, "pool", None)
            overhead.observe(pool.name if pool is not None else "", self.overhead_ms())
            if self.span is not None:
                self._end_span(pool)

    def _end_span(self, pool: PoolInfo | None) -> None:
        """The request span's attributes (ids, names, counts, codes; never content)."""
        span = self.span
        assert span is not None
        principal: Principal | None = getattr(self, "principal", None)
        usage = self.usage_seen
        tracing.set_attributes(
            span, http__response__status_code=self.status or None,
            gen_ai__request__model=getattr(self, "logged_model", None),
            pool=pool.name if pool is not None else None,
            tenant=principal.tenant_slug if principal else None,
            tenant__id=principal.tenant_id if principal else None,
            project=principal.project_id if principal else None,
            key__prefix=principal.key_prefix if principal else None,
            gen_ai__usage__input_tokens=usage.prompt_tokens if usage else None,
            gen_ai__usage__output_tokens=usage.completion_tokens if usage else None,
            request__id=self.request_id, gateway__overhead_ms=round(self.overhead_ms(), 3),
            error__code=getattr(self, "error_code", None))
        if self.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    async def log_refusal(self, err: ApiError) -> None:
        """A refused request (never admitted) goes to its tenant's request log; an admitted one
        is logged from its usage record, an anonymous one belongs to no tenant."""
        principal: Principal | None = getattr(self, "principal", None)
        if principal is None or getattr(self, "submission", None) is not None:
            return
        pool = getattr(self, "pool", None)
        item = requestlog.refusal_json(
            request_id=self.request_id, tenant_id=principal.tenant_id, key_id=principal.key_id,
            model=getattr(self, "logged_model", ""), pool=pool.name if pool is not None else "",
            http_status=err.status, error_code=err.code or err.type,
            end_user=getattr(self, "end_user", "") or None, project_id=principal.project_id,
            stream=getattr(self, "stream", False),
            prompt_tokens=getattr(self, "prompt_tokens", 0),
            total_ms=(time.perf_counter() - self.began) * 1000)
        try:
            await requestlog.arecord_refusal(get_async_redis(), item)
        except redis.RedisError:
            log.warning("request %s: refusal not logged (Redis unavailable)", self.request_id)

    def noted(self, model: str, stream: bool) -> None:
        """What the request log shows of a parsed request (never its content; the end user is
        ``self.end_user``, set with the request)."""
        self.logged_model, self.stream = model, stream

    def overhead_ms(self) -> float:
        """Time in the gateway so far, less the wait for the worker (metering.overhead)."""
        return max(0.0, (time.perf_counter() - self.began - self.waited) * 1000)

    async def timed(self, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        """The submission's events; the time spent awaiting each one is the worker's, not ours."""
        it = aiter(events)
        try:
            while True:
                waiting = time.perf_counter()
                try:
                    event = await anext(it)
                except StopAsyncIteration:
                    return
                finally:
                    self.waited += time.perf_counter() - waiting
                if isinstance(event, FinishEvent):
                    self.usage_seen = event.usage
                yield event
        finally:
            closing = getattr(it, "aclose", None)
            if closing is not None:
                await closing()

    async def _handle(self, body: bytes) -> None:
        try:
            try:
                await self.handle(body)
            except cells.WrongCell as wrong:
                # Nested, so the forward's own refusals (400, 503) are answered below too.
                await self._forward(body, wrong)
        except ApiError as err:
            self.error_code = err.code or err.type
            await self.send_error(err)
            await self.log_refusal(err)
        except redis.RedisError:
            # The shared state is unreachable: nothing could be charged, so a retry is safe.
            log.exception("request %s: Redis unavailable", self.request_id)
            await self.send_error(unavailable("The service is temporarily unavailable.",
                                              retry_after=2))
        except Exception:
            log.exception("request %s failed", self.request_id)
            await self.send_error(server_error())

    async def _forward(self, body: bytes, wrong: cells.WrongCell) -> None:
        """Serve the request from the tenant's home cell (inference.cells); nothing runs here."""
        async def send(message: dict[str, Any]) -> None:
            self.started = True
            await self._send(message)
            self.finished = not message.get("more_body", message["type"] != "http.response.body")

        await cells.forward(self.scope, body, wrong, send)

    def headers_dict(self) -> dict[str, str]:
        return {k.decode("latin-1").lower(): v.decode("latin-1")
                for k, v in self.scope.get("headers", ())}

    def header(self, name: bytes) -> str | None:
        key: bytes
        value: bytes
        for key, value in self.scope.get("headers", ()):
            if key.lower() == name:
                return value.decode("latin-1")
        return None

    # -- writing -----------------------------------------------------------------------------

    async def _send(self, message: dict[str, Any]) -> None:
        if self.disconnected.is_set() or self.finished:
            return
        try:
            await self.base_send(message)
        except Exception:  # the connection went away under us (uvicorn raises OSError kinds)
            self.disconnected.set()

    async def start(self, status: int, headers: Mapping[str, str],
                    extra: list[tuple[bytes, bytes]]) -> None:
        async with self._write_lock:
            await self._start_locked(status, headers, extra)

    async def _start_locked(self, status: int, headers: Mapping[str, str],
                            extra: list[tuple[bytes, bytes]]) -> None:
        if self.started:
            return
        self.started = True
        self.status = status
        raw = [*extra, (b"x-request-id", self.request_id.encode()),
               (OVERHEAD_HEADER, b"%.2f" % self.overhead_ms())]
        if (trace_id := tracing.trace_id(self.span)) is not None:
            raw.append((TRACE_HEADER, trace_id.encode()))
        if settings.CELL:
            raw.append((cells.CELL_HEADER, settings.CELL.encode()))
        raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        await self._send({"type": "http.response.start", "status": status, "headers": raw})

    async def write(self, data: bytes, *, more: bool = True) -> None:
        async with self._write_lock:
            await self._send({"type": "http.response.body", "body": data, "more_body": more})
            if not more:
                self.finished = True

    async def send_json(self, status: int, body: bytes,
                        headers: Mapping[str, str] | None = None) -> None:
        await self.start(status, headers or {}, [JSON, (b"content-length", b"%d" % len(body))])
        await self.write(body, more=False)

    async def send_error(self, err: ApiError) -> None:
        if not self.started:
            await self.send_json(err.status, err.body(), err.headers)
        elif not self.finished:
            # Mid-stream: an event the official client raises as APIError, then the end.
            await self.write(sse.event(err.body()), more=False)

    async def authenticate(self) -> Principal:
        try:
            # An API key, else an OIDC bearer token, else a client certificate bound to a
            # tenant (trusted only from configured proxies): the tenant comes from the credential.
            with tracing.child(self.span, "authenticate"):
                principal = await aauthenticate_scope_request(self.scope)
        except AuthError as err:
            raise ApiError(err.status, err.message, type=err.type, code=err.code,
                           headers=err.headers) from None
        # Served only by the tenant's cells: from any other, forwarded home (docs/adr/0019).
        cells.check_cell(principal.tenant_cells, self.scope.get("headers", []))
        return principal


class ModelsConsumer(ApiConsumer):
    """GET /v1/models and /v1/models/{model}: only the models this key may use."""

    methods = ("GET",)

    async def handle(self, body: bytes) -> None:
        principal = await self.authenticate()
        models = await visible_models(principal.tenant_id, principal.tenant_region,
                                      principal.allowed_model_names)
        created = {m.name: m.created for m in models}
        wanted = self.scope.get("url_route", {}).get("kwargs", {}).get("model")
        entries = model_entries(sorted(created), created, principal.tenant_slug)
        if wanted is None:
            await self.send_json(200, dumps({"object": "list", "data": entries}))
            return
        for entry in entries:
            if entry["id"] == wanted:
                await self.send_json(200, dumps(entry))
                return
        raise model_not_found(wanted)


class MetricsConsumer(ApiConsumer):
    """GET /metrics: Prometheus text, the same from every process (``metering.metrics``).

    Set METRICS_TOKEN to require ``Authorization: Bearer <token>``: the labels name tenants.
    Without it only clients on this host (loopback, Unix socket) may read it.
    """

    methods = ("GET",)

    async def handle(self, body: bytes) -> None:
        token = settings.METRICS_TOKEN
        if token:
            given = (self.header(b"authorization") or "").encode("latin-1")
            if not hmac.compare_digest(given, f"Bearer {token}".encode()):
                raise ApiError(401, "A valid metrics token is required.", code="invalid_api_key",
                               headers={"www-authenticate": "Bearer"})
        elif not clientaddr.is_local(self.scope):
            # The labels name every tenant: without a token only this host may read them.
            raise ApiError(403, "Set METRICS_TOKEN to read /metrics from another host.",
                           type="permission_error", code="metrics_local_only")
        text = await in_thread(metrics.render)()
        payload = text.encode()
        await self.start(200, {}, [(b"content-type", metrics.CONTENT_TYPE.encode()),
                                   (b"content-length", b"%d" % len(payload))])
        await self.write(payload, more=False)


class NotFoundConsumer(ApiConsumer):
    methods = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")

    async def handle(self, body: bytes) -> None:
        raise ApiError(404, f"Unknown request URL: {self.scope['method']} {self.scope['path']}.",
                       code="unknown_url")


class CompletionConsumer(ApiConsumer):
    """POST /v1/chat/completions and POST /v1/completions (``kind`` set by the subclasses)."""

    kind: Kind = "chat"

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        self.submission: Submission | Failover | None = None
        # Holds an Idempotency-Key claim: a client that hangs up (a timeout) will retry with
        # the key, so the request runs on and its answer is stored for the retry to replay,
        # instead of being cancelled and run (and paid) again.
        self.finish_detached = False
        await super().__call__(scope, receive, send)

    resumable = True

    def parse_request(self, data: dict[str, Any]) -> InferenceRequest:
        return parse_object(data, self.kind)

    async def on_disconnect(self) -> None:
        if self.submission is not None and not self.finish_detached:
            await self.submission.cancel("client_disconnect")

    async def handle(self, body: bytes) -> None:
        principal = await self.authenticate()
        self.principal = principal
        data = load_json_object(body)
        req = self.parse_request(data)
        self.end_user = end_user_of(data, self.headers_dict(), principal.end_user_header)
        self.noted(req.model, req.stream)
        resume = sse.parse_resume_id(self.header(b"last-event-id")) if self.resumable else None
        if resume is not None and req.stream:
            await self._resume(principal, req, *resume)
            return
        self.router = Router(req.model, principal, req.fallbacks, req.prompt_cache_key)
        if await self._from_cache(principal, req, data):
            return
        target, prepared = await self._first_target(req)
        limits = principal.limits(target.served_model)
        claim = await self._idempotency(principal, data, req, limits.total_deadline_s)
        if isinstance(claim, idempotency.Replay):
            await self.send_json(claim.status, claim.body, {"idempotent-replayed": "true"})
            return
        self.finish_detached = claim is not None
        try:
            status, answer = await self._serve(principal, req, target, prepared)
        except BaseException:
            if claim is not None:
                await asyncio.shield(claim.abandon())
            raise
        if claim is not None:
            await (claim.store(status, answer) if status == 200 else claim.abandon())

    async def _idempotency(self, principal: Principal, data: dict[str, Any],
                           req: InferenceRequest, deadline_s: float
                           ) -> idempotency.Claim | idempotency.Replay | None:
        value = self.header(b"idempotency-key")
        if value is None or req.stream:
            return None
        return await idempotency.begin(principal.tenant_id, idempotency.checked_key(value),
                                       idempotency.body_hash(data), deadline_s + 60)

    cacheable = True  # the Responses API answers in other shapes: not from this cache

    async def _from_cache(self, principal: Principal, req: InferenceRequest,
                          data: dict[str, Any]) -> bool:
        """Answer from the tenant's response cache when it opted in and has this answer
        (gateway.inference.cache); True when answered. On a miss the answer is stored at its
        end (``remember``)."""
        self.cache_digest: str | None = None
        how = cache.mode(principal, self.header(cache.HEADER.encode()), req) \
            if self.cacheable else None
        if how is None:
            return False
        await targets_for(req.model, principal)  # 404 for a model this key may not call
        self.cache_digest = cache.digest(req.kind, data)
        self.cache_state = "refresh" if how == "refresh" else "miss"
        if how == "refresh":
            return False
        entry = await cache.response_cache.get(principal.tenant_id, self.cache_digest)
        if entry is None:
            return False
        self.cache_state = "hit"
        await self._answer_cached(req, entry)
        return True

    async def _answer_cached(self, req: InferenceRequest, entry: cache.Entry) -> None:
        self.served_model = entry.model
        await cache.meter_hit(self.principal, self.request_id, entry, stream=req.stream)
        usage = UsageCounts(entry.prompt_tokens, entry.completion_tokens, entry.prompt_tokens)
        created = created_of(self.request_id)
        if not req.stream:
            body = completion_body(req.kind, self.request_id, created, entry.model,
                                   "".join(entry.pieces), entry.finish_reason, usage)
            await self.send_json(200, dumps(body), self.served_headers(req))
            return
        tpl = ChunkTemplate(req.kind, self.request_id, created, entry.model, req.include_usage)
        parts = [sse.event(tpl.role())] if req.kind == "chat" else []
        parts += [sse.event(tpl.delta(piece)) for piece in entry.pieces]
        parts.append(sse.event(tpl.finish(entry.finish_reason)))
        if req.include_usage:
            parts.append(sse.event(tpl.usage(usage)))
        parts.append(sse.DONE)
        await self.start(200, self.served_headers(req), sse.HEADERS)
        await self.write(b"".join(parts), more=False)

    async def remember(self, req: InferenceRequest, pieces: list[str],
                       event: FinishEvent) -> None:
        """Store a finished answer in the tenant's cache when this request is cached."""
        if getattr(self, "cache_digest", None) is None or event.finish_reason not in \
                FINISH_REASONS or self.cache_state == "hit":
            return
        entry = cache.Entry(self.answer_model(req), self.pool.name, pieces, event.finish_reason,
                            event.usage.prompt_tokens, event.usage.completion_tokens)
        try:
            await cache.response_cache.put(self.principal.tenant_id, str(self.cache_digest),
                                           entry)
        except redis.RedisError:  # the answer was sent; a cache that cannot store just misses
            log.warning("response cache store failed for %s", self.request_id)

    async def _first_target(self, req: InferenceRequest) -> tuple[Target, Prepared]:
        """The first target that takes the request; an overloaded one is passed over for the
        next (its priority's other targets, then the fallbacks: gateway.inference.routes)."""
        while True:
            target = await self.router.pick()
            try:
                return target, await self._prepare(req, target)
            except ApiError as exc:
                if exc.code != "overloaded":
                    raise
                self.router.exclude(target, "overloaded")

    async def _prepare(self, req: InferenceRequest, target: Target) -> Prepared:
        """Tokenize and size the request for one target's model; refuse what it cannot take."""
        pool = target.pool
        if pool.model.task == "embed":
            raise ApiError(400, f"The model `{req.model}` is an embedding model: use "
                           "/v1/embeddings.", param="model", code="invalid_value")
        limits = self.principal.limits(target.served_model)
        # Both checks use what the router's pick read (no round trips of their own).
        async with oversize.counted(self.principal.tenant_id,  # repeated 400s for size: 429
                                    self.router.oversize_read):
            prompt_ids = await tokenize(req, pool.model)
            sized = size_request(req, prompt_ids, await serving_model(pool), limits)
        sampling = sampling_params(req, sized.max_tokens, pool.model.tool_call_parser)
        check_supported(req, sampling, pool)
        await overload.check(pool.name, pool.max_sequences, self.principal.tenant_id,
                             self.router.overload_readings.get(pool.name))
        return Prepared(sized.prompt_token_ids, sampling)

    def _use(self, target: Target) -> None:
        """Answer as ``target``: its pool's tool parser and tokenizer, its model's name."""
        self.pool = target.pool
        self.served_model = target.served_model

    async def _submit(self, req: InferenceRequest, target: Target, prepared: Prepared,
                      request_id: str) -> Submission | Rejection:
        self.prompt_tokens = len(prepared.prompt_ids)
        with tracing.child(self.span, "admission", pool=target.pool.name):
            return await submit_request(
                request_id=request_id, principal=self.principal, pool=target.pool.name,
                model=target.served_model, prompt_token_ids=prepared.prompt_ids,
                sampling=prepared.sampling, stream=req.stream, adapter=target.pool.adapter,
                end_user=self.end_user, trace=tracing.carrier(self.span),
                shape=stream_shape(req))

    async def _serve(self, principal: Principal, req: InferenceRequest, target: Target,
                     prepared: Prepared) -> tuple[int, bytes]:
        """Submit and answer; returns the non-streaming answer (for idempotency) or (0, b"")."""
        self._use(target)
        result = await self._submit(req, target, prepared, self.request_id)
        if isinstance(result, Rejection):
            await metrics.count_rejection(get_async_redis(), principal.tenant_id,
                                          target.served_model, result.reason)
            raise rejection_error(result)
        sub = Failover(target, result, functools.partial(self._next_attempt, req), self._use,
                       self._can_move)
        self.submission = sub
        if self.disconnected.is_set():  # gone while we were admitting
            await sub.cancel("client_disconnect")
        headers = result.rate_limit.headers()
        if req.stream:
            await self.relay(req, sub, headers)
            return 0, b""
        return await self._collect(req, sub, headers)

    async def _can_move(self) -> bool:
        """Whether another target could take this request now (its pool lost its workers)."""
        router = self.router
        if self.disconnected.is_set() or not router.may_retry() or \
                not isinstance(self.submission, Failover):
            return False
        excluded, reasons = set(router.excluded), dict(router.reasons)
        router.excluded.add(self.submission.target.pool.name)
        try:
            await router.pick()
            return True
        except ApiError:
            return False
        finally:
            router.excluded, router.reasons = excluded, reasons

    async def _next_attempt(self, req: InferenceRequest,
                            failure: str) -> tuple[Target, Submission] | None:
        """Another target after a failure before the first token (gateway.inference.failover);
        None when the route allows no more attempts or nothing else can take it."""
        router = self.router
        if self.disconnected.is_set() or not router.may_retry():
            return None
        assert isinstance(self.submission, Failover)
        router.exclude(self.submission.target, failure)
        router.failures += 1
        while True:
            try:
                target = await router.pick()
                prepared = await self._prepare(req, target)
            except ApiError as exc:
                if exc.code == "overloaded":
                    router.exclude(target, "overloaded")
                    continue
                return None
            rid = f"{self.request_id}-{router.failures}"
            result = await self._submit(req, target, prepared, rid)
            if isinstance(result, Rejection):
                return None  # the tenant's own limits: the first failure stands
            return target, result

    async def relay(self, req: InferenceRequest, sub: Submission | Failover,
                    headers: dict[str, str]) -> None:
        await Relay(self, req, self.timed(sub.events()), headers).run()

    async def _resume(self, principal: Principal, req: InferenceRequest, rid: str,
                      last_id: str) -> None:
        """A reconnect with Last-Event-ID: replay the same request's stream after that entry."""
        found = await attach(rid, principal.tenant_id)
        if found is None:
            raise ApiError(404, "No stream to resume for this Last-Event-ID (it may have "
                           "expired).", param="Last-Event-ID", code="stream_not_found")
        check_resume_shape(req, found.shape)
        self.request_id = rid
        self.submission = found
        if needs_assembler(req):
            # The assembler needs the model's tool parser and tokenizer.
            pool = await choose_pool(req.model, principal.tenant_id, principal.tenant_region,
                                     principal.allowed_model_names, served_only=False)
            self.pool = pool
        await Relay(self, req, self.timed(found.events(last_id)), {}, resumed=True).run()

    def assembler(self, req: InferenceRequest) -> Assembler | None:
        """The choice assembler for requests off the plain text path (tools, n, logprobs)."""
        if not needs_assembler(req):
            return None
        model = self.pool.model
        return Assembler(req, get_parser(model.tool_call_parser),
                         load_tokenizer(model.tokenizer_path), framed(req))

    def answer(self, req: InferenceRequest, asm: Assembler, usage: UsageCounts) -> bytes:
        """A whole response from a finished assembler."""
        return dumps(choices_body(req.kind, self.request_id, created_of(self.request_id),
                                         self.answer_model(req), asm.choices(), usage))

    def answer_model(self, req: InferenceRequest) -> str:
        """The ``model`` an answer names: the one that actually served it."""
        return getattr(self, "served_model", None) or req.model

    def served_headers(self, req: InferenceRequest) -> dict[str, str]:
        headers = {SERVED_HEADER: self.answer_model(req)}
        if getattr(self, "cache_digest", None) is not None:
            headers["x-cache"] = self.cache_state
        return headers

    async def _collect(self, req: InferenceRequest, sub: Submission | Failover,
                       headers: dict[str, str]) -> tuple[int, bytes]:
        pieces: list[str] = []
        tokens = 0
        asm = self.assembler(req)
        async for event in self.timed(sub.events()):
            if isinstance(event, TokenEvent):
                if asm is not None:
                    asm.feed(event.text)
                else:
                    pieces.append(event.text)
                tokens += event.token_count
            elif isinstance(event, FinishEvent) and event.finish_reason in FINISH_REASONS:
                usage = usage_counts(event.usage)
                created = created_of(self.request_id)
                if asm is not None:
                    asm.finish(event.finish_reason)
                    texts = asm.texts()
                    text = texts[0] if len(texts) == 1 else "\n\n".join(texts)
                    answer = self.answer(req, asm, usage)
                else:
                    text = "".join(pieces)
                    answer = dumps(completion_body(
                        req.kind, self.request_id, created, self.answer_model(req), text,
                        event.finish_reason, usage))
                await self.send_json(200, answer, {**headers, **self.served_headers(req)})
                if asm is None:
                    await self.remember(req, pieces, event)
                await self.log_content(req, text)
                return 200, answer
            else:
                raise failure(event, tokens)
        raise unavailable("The stream ended without a result.")


    async def log_content(self, req: InferenceRequest, response: str) -> None:
        """Hand prompt and response to the encrypted content log, only for opted-in tenants.

        After the answer is sent, so it never delays the client; the store encrypts under the
        tenant's key, queues in Redis and never raises (gateway.contentlog.store).
        """
        principal = self.principal
        if not principal.content_logging:
            return
        prompt: Any = list(req.messages) if req.kind == "chat" else req.prompt
        if isinstance(prompt, tuple):
            prompt = list(prompt)
        await aenqueue_content(self.request_id, principal.tenant_id, prompt, response,
                               opted_in=True)


class ChatCompletionsConsumer(CompletionConsumer):
    kind: Kind = "chat"


class CompletionsConsumer(CompletionConsumer):
    kind: Kind = "completion"


class EmbeddingsConsumer(CompletionConsumer):
    """POST /v1/embeddings (``gateway.inference.embeddings``): admitted, queued, settled and
    cancelled on disconnect like a completion; the worker pools instead of generating."""

    async def handle(self, body: bytes) -> None:
        principal = await self.authenticate()
        self.principal = principal
        data = load_json_object(body)
        req = embeddings.parse(data)
        self.end_user = end_user_of(data, self.headers_dict(), principal.end_user_header)
        self.noted(req.model, False)
        # The router's health check refuses at once a model whose pools have no live worker.
        router = Router(req.model, principal)
        pool = (await router.pick()).pool
        self.pool = pool
        if pool.model.task != "embed":
            raise ApiError(400, f"The model `{req.model}` does not serve embeddings.",
                           param="model", code="invalid_value")
        prompts = await asyncio.to_thread(embeddings.tokenize, req, pool.model,
                                          principal.limits(req.model))
        await overload.check(pool.name, pool.max_sequences, principal.tenant_id,
                             router.overload_readings.get(pool.name))
        with tracing.child(self.span, "admission", pool=pool.name):
            result = await submit_request(
                request_id=self.request_id, principal=principal, pool=pool.name,
                model=req.model, prompt_token_ids=[t for p in prompts for t in p],
                sampling=embeddings.sampling(req, prompts), stream=False,
                adapter=pool.adapter, end_user=self.end_user,
                trace=tracing.carrier(self.span))
        if isinstance(result, Rejection):
            await metrics.count_rejection(get_async_redis(), principal.tenant_id, req.model,
                                          result.reason)
            raise rejection_error(result)
        self.submission = result
        if self.disconnected.is_set():
            await result.cancel("client_disconnect")
        vectors: list[list[float]] = []
        async for event in self.timed(result.events(first="The embeddings")):
            if isinstance(event, TokenEvent):
                vectors = embeddings.unpack(event.text)
            elif isinstance(event, FinishEvent) and event.finish_reason == "stop":
                answer = embeddings.body(req, vectors, event.usage.prompt_tokens)
                await self.send_json(200, dumps(answer), result.rate_limit.headers())
                return
            else:
                raise failure(event, 0)
        raise unavailable("The request ended without a result.")


class ResponsesConsumer(CompletionConsumer):
    """POST /v1/responses: a chat completion answered in the Responses API's shapes
    (``gateway.inference.responses_api``). Not resumable: its events carry no ids."""

    kind: Kind = "chat"
    resumable = False
    cacheable = False

    async def handle(self, body: bytes) -> None:
        try:
            await super().handle(body)
        except ApiError as err:
            err.param = responses_param(err.param)  # the chat field names as sent in Responses
            raise

    def parse_request(self, data: dict[str, Any]) -> InferenceRequest:
        self.body_data = data
        return parse_object(to_chat(data), "chat")

    def assembler(self, req: InferenceRequest) -> Assembler:
        model = self.pool.model
        return Assembler(req, get_parser(model.tool_call_parser),
                         load_tokenizer(model.tokenizer_path), framed(req))

    def answer(self, req: InferenceRequest, asm: Assembler, usage: UsageCounts) -> bytes:
        builder = ResponseBuilder(self.request_id, req.model, self.body_data)
        return dumps(builder.whole(asm, usage))

    async def relay(self, req: InferenceRequest, sub: Submission | Failover,
                    headers: dict[str, str]) -> None:
        asm = self.assembler(req)
        builder = ResponseBuilder(self.request_id, req.model, self.body_data)
        tokens = 0
        ticker = asyncio.create_task(self._keepalive(headers, builder))
        try:
            async for event in self.timed(sub.events()):
                if isinstance(event, TokenEvent):
                    await self._begin(headers, builder)
                    tokens += event.token_count
                    await self.write(dumps_events(builder.feed(asm.feed(event.text))))
                elif isinstance(event, FinishEvent) and \
                        event.finish_reason in FINISH_REASONS:
                    await self._begin(headers, builder)
                    events = builder.feed(asm.finish(event.finish_reason))
                    events += builder.end(usage_counts(event.usage))
                    await self.write(dumps_events(events), more=False)
                    texts = asm.texts()
                    await self.log_content(req, texts[0] if texts else "")
                    return
                else:
                    raise failure(event, tokens)
            raise unavailable("The stream ended without a result.")
        finally:
            ticker.cancel()

    async def _begin(self, headers: dict[str, str], builder: ResponseBuilder) -> None:
        if not self.started:
            await self.start(200, headers, sse.HEADERS)
            await self.write(dumps_events(builder.start()))

    async def _keepalive(self, headers: dict[str, str], builder: ResponseBuilder) -> None:
        while True:
            await asyncio.sleep(settings.SSE_KEEPALIVE_SECONDS)
            await self._begin(headers, builder)
            await self.write(sse.KEEPALIVE)


class Relay:
    """One SSE response: headers on the first event, keep-alives while idle, [DONE] at the end."""

    def __init__(self, consumer: CompletionConsumer, req: InferenceRequest,
                 events: AsyncIterator[Event], headers: Mapping[str, str],
                 *, resumed: bool = False) -> None:
        self.c = consumer
        self.req = req
        self.events = events
        self.headers = headers
        self.resumed = resumed
        self.tpl = self._template()
        self.asm = consumer.assembler(req)
        self.id_prefix = consumer.request_id + sse.RESUME_SEPARATOR
        self._id_head = b"id: " + self.id_prefix.encode()
        self.tokens = 0
        self.last_write = time.monotonic()
        # Events already here are joined into one write: under load the relay falls behind by
        # a step or two, and one send per event (uvicorn's send, a syscall) is what it costs.
        self._buf: list[bytes] = []
        submission = consumer.submission
        self._pending: Callable[[], bool] = (
            submission.pending if submission is not None else lambda: False)
        # Text is kept only for tenants that opted in to content logging (off by default).
        principal = getattr(consumer, "principal", None)
        self.pieces: list[str] | None = (
            [] if principal is not None and principal.content_logging and not resumed else None
        )
        # The deltas as streamed, for the response cache (only when this request is cached).
        self.cached: list[str] | None = (
            [] if getattr(consumer, "cache_digest", None) and not resumed else None)

    async def run(self) -> None:
        ticker = asyncio.create_task(self._keepalive())
        pump = asyncio.create_task(self._pump())
        revoked: list[AuthError] = []

        def end(error: AuthError) -> None:  # the credential stopped working mid-stream
            revoked.append(error)
            pump.cancel()

        try:
            principal = getattr(self.c, "principal", None)
            with revocation.watching(self.c.scope, end,
                                     getattr(principal, "expires_at", None)):
                await pump
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not revoked or (current is not None and current.cancelling()):
                raise
            await self._end_revoked(revoked[0])
        finally:
            ticker.cancel()
            pump.cancel()

    async def _end_revoked(self, error: AuthError) -> None:
        """Stop generating (the worker settles the tokens generated so far), send what was
        already here, then the error event the official client raises."""
        submission = self.c.submission
        if submission is not None:
            await asyncio.shield(submission.cancel("credential_revoked"))
        await self._flush()
        raise ApiError(error.status, error.message, type=error.type, code=error.code)

    def _template(self) -> ChunkTemplate:
        c = self.c
        return ChunkTemplate(self.req.kind, c.request_id, created_of(c.request_id),
                             c.answer_model(self.req), self.req.include_usage)

    async def _begin(self) -> None:
        if self.c.started:
            return
        # Named now, not when the request was admitted: a retry before the first token may
        # have moved it to another target (gateway.inference.failover). The resume id names
        # the attempt whose stream the events come from.
        self.tpl = self._template()
        submission = self.c.submission
        if submission is not None and not self.resumed:
            self.id_prefix = submission.request_id + sse.RESUME_SEPARATOR
            self._id_head = b"id: " + self.id_prefix.encode()
        await self.c.start(200, {**self.headers, **self.c.served_headers(self.req)},
                           sse.HEADERS)
        if self.req.kind == "chat" and not self.resumed:
            # Queued, not written: it goes out with the first tokens, in one send (the
            # caller flushes), rather than a send of its own per request.
            if self.asm is not None:
                self._buf.extend(sse.event(self.tpl.choice(c)) for c in self.asm.role_chunks())
            else:
                self._buf.append(sse.event(self.tpl.role()))

    async def _write(self, data: bytes, *, more: bool = True) -> None:
        self.last_write = time.monotonic()
        await self.c.write(data, more=more)

    async def _pump(self) -> None:
        async for event in self.events:
            if self.c.disconnected.is_set():
                return
            if isinstance(event, TokenEvent):
                if not self.c.started:
                    await self._begin()
                self.tokens += event.token_count
                if self.pieces is not None:
                    self.pieces.append(event.text)
                if self.cached is not None:
                    self.cached.append(event.text)
                if self.asm is not None:
                    self._chunks(self.asm.feed(event.text), event.event_id)
                else:
                    self._buf.append(b"%s%s\ndata: %s\n\n" % (
                        self._id_head, event.event_id.encode(), self.tpl.delta(event.text)))
                if not self._pending():
                    await self._flush()
            elif isinstance(event, FinishEvent) and event.finish_reason in FINISH_REASONS:
                await self._begin()
                if self.asm is not None:
                    self._chunks(self.asm.finish(event.finish_reason), event.event_id)
                    if self.pieces is not None:
                        texts = self.asm.texts()
                        self.pieces = [texts[0] if len(texts) == 1 else "\n\n".join(texts)]
                else:
                    self._buf.append(sse.event(self.tpl.finish(event.finish_reason),
                                               self.id_prefix + event.event_id))
                if self.req.include_usage:
                    self._buf.append(sse.event(self.tpl.usage(usage_counts(event.usage))))
                self._buf.append(sse.DONE)
                await self._flush(more=False)
                if self.cached is not None and self.asm is None:
                    await self.c.remember(self.req, self.cached, event)
                if self.pieces is not None:
                    await self.c.log_content(self.req, "".join(self.pieces))
                return
            else:
                await self._flush()  # the tokens before the error event
                raise failure(event, self.tokens)
        await self._flush()
        raise unavailable("The stream ended without a result.")

    def _chunks(self, choices: list[dict[str, Any]], event_id: str) -> None:
        """Chunks for the assembler's choices; the last carries the entry id (resume point)."""
        for k, choice in enumerate(choices):
            last = k == len(choices) - 1
            self._buf.append(sse.event(self.tpl.choice(choice),
                                       self.id_prefix + event_id if last else None))

    async def _flush(self, *, more: bool = True) -> None:
        if self._buf or not more:
            data = b"".join(self._buf)
            self._buf.clear()
            await self._write(data, more=more)

    async def _keepalive(self) -> None:
        every = settings.SSE_KEEPALIVE_SECONDS
        while True:
            await asyncio.sleep(every / 2)
            if time.monotonic() - self.last_write >= every:
                await self._begin()
                self._buf.append(sse.KEEPALIVE)  # behind the role chunk _begin queued
                await self._flush()


FINISH_REASONS = frozenset({"stop", "length"})
SERVED_HEADER = "x-served-model"  # the model that actually served (a route or a fallback)


@dataclass(frozen=True)
class Prepared:
    """A request tokenized and sized for one target."""

    prompt_ids: list[int]
    sampling: SamplingParams


def new_request_id() -> str:
    """Milliseconds since the epoch (11 hex digits) + 80 random bits.

    The time prefix makes ``created`` recoverable from the id alone, so a stream resumed from
    another process carries the same ``created`` as the original.
    """
    return f"{time.time_ns() // 1_000_000:011x}{secrets.token_hex(10)}"


def created_of(request_id: str) -> int:
    try:
        return int(request_id[:11], 16) // 1000
    except ValueError:
        return int(time.time())


def rejection_error(rejection: Rejection) -> ApiError:
    headers = rejection.headers()
    if rejection.reason == "insufficient_quota":
        # A budget: waiting helps only once its period resets (Retry-After says when; none for
        # a lifetime budget or a key stopped by a hard cap, which an owner must raise).
        if rejection.retry_after <= 0:
            headers["x-should-retry"] = "false"
        return ApiError(429, rejection.message, type="insufficient_quota",
                        code="insufficient_quota", headers=headers)
    if rejection.too_large:
        # Waiting cannot help: tell the official client not to retry (it honours this header).
        headers["x-should-retry"] = "false"
        code = "request_too_large"
    else:
        code = "rate_limit_exceeded"
    return rate_limited(rejection.message, code=code, retry_after=None, headers=headers)


def failure(event: ErrorEvent | FinishEvent, tokens_sent: int) -> ApiError:
    """The error a failed generation answers with (or sends as its last stream event)."""
    if isinstance(event, FinishEvent):  # aborted by someone else (a cancel, shedding)
        code, message, retryable, param = "request_cancelled", "The request was cancelled.", \
            True, None
    else:
        code, message, retryable, param = event.code, event.message, event.retryable, event.param
    if tokens_sent == 0 and code == "engine_refused":
        # The engine turned this request down before any work (workers.host): the request is
        # at fault, and nothing was charged.
        return ApiError(400, message, type="invalid_request_error", param=param, code=code)
    if tokens_sent == 0 and retryable:
        # Nothing was generated, so nothing was billed: the client may simply try again.
        return unavailable(message, retry_after=1, code=code)
    status = 504 if "deadline" in code else (503 if retryable else 500)
    return ApiError(status, message, type="server_error", code=code)
