"""An OpenAI-compatible server (``vllm serve``, llama.cpp's server) behind the engine interface.

The worker forwards each request to ``POST {base_url}/v1/completions`` with ``stream: true``
and relays the chunks as deltas. What the gateway needs from the upstream differs by server,
so a ``dialect`` picks the defaults:

- ``vllm``: the prompt goes as token ids (the ids the gateway counted and charged), with the
  tenant's ``cache_salt`` (I1), ``return_token_ids`` (each chunk carries its token ids) and
  ``stream_options.include_usage`` (a final chunk with the engine's usage and
  ``prompt_tokens_details.cached_tokens``); ``priority`` when the fleet runs vLLM's priority
  scheduler.
- ``llama_cpp`` (llama-cpp-python's server): the prompt goes as text (the server's completions
  endpoint takes strings), nothing vLLM-specific is sent, and no usage chunk comes back when
  streaming, so the worker counts output tokens itself.
- ``openai``: the plain OpenAI wire format (text prompt, usage chunk, nothing else).

Counting (the design's "tokenizer mismatch" failure): output tokens are the upstream's token
ids where it sends them, else the model's tokenizer over the streamed text, except that a
request stopped by ``length`` generated exactly the ``max_tokens`` it was sent. The upstream's
own usage, when reported, is authoritative and reconciles the count (a difference is logged).

Logprobs: asked of the completions endpoint (``logprobs``: k) and mapped to token ids, the
unit the worker frames and the gateway renders (``upstream_logprobs``): vLLM is asked for
``return_tokens_as_token_ids`` (exact); llama.cpp sends token text, mapped with the model's
tokenizer.

Cancelling: ``abort`` (or closing the delta iterator) cancels the request's task, which closes
the upstream response and so its connection; both vLLM and llama.cpp's server stop generating
when the client goes. Timeouts are bounded: connect, first byte (queueing + prefill upstream),
and idle time between chunks. Errors: connection failures, timeouts, 5xx and 429 are
retryable; other 4xx are final (the request itself is wrong).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import urllib.request
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from infra.quietlog import Repeated
from serving.adapters import AdapterCatalog, AdapterNotFound
from serving.tokenization import HFTokenizer, load_tokenizer
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
from workers.engine.pumped import PumpedStream, PumpedStreams
from workers.engine.structured import for_vllm
from workers.engine.upstream_http import UpstreamHTTP, headers_of

log = logging.getLogger(__name__)
USAGE_DIFFERS = Repeated(log, "upstream_usage_differs")

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT,
           "eos": FinishReason.STOP}

# dialect -> defaults of (prompt_format, send_cache_salt, return_token_ids, include_usage,
# vllm_sampling: stop_token_ids / ignore_eos)
DIALECTS: dict[str, dict[str, Any]] = {
    "vllm": {"prompt_format": "token_ids", "send_cache_salt": True, "return_token_ids": True,
             "include_usage": True, "vllm_sampling": True},
    "llama_cpp": {"prompt_format": "text", "send_cache_salt": False, "return_token_ids": False,
                  "include_usage": False, "vllm_sampling": False},
    "openai": {"prompt_format": "text", "send_cache_salt": False, "return_token_ids": False,
               "include_usage": True, "vllm_sampling": False},
}


@dataclass(frozen=True)
class UpstreamSettings:
    base_url: str
    model: str  # the upstream's name for the model
    dialect: str = "vllm"
    prompt_format: str = "token_ids"  # or "text"
    send_cache_salt: bool = True
    return_token_ids: bool = True
    include_usage: bool = True
    vllm_sampling: bool = True
    send_priority: bool = False
    api_key_env: str | None = None  # the key is read from this variable, never stored in the DB
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 120.0
    idle_timeout_s: float = 30.0
    max_connections: int = 64
    max_model_len: int = 8192
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {sorted(DIALECTS)}")
        if self.prompt_format not in ("token_ids", "text"):
            raise ValueError('prompt_format must be "token_ids" or "text"')
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError("base_url must be an http(s) URL")
        for name in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"{name} must be in (0, 3600] seconds")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")

    @classmethod
    def for_dialect(cls, dialect: str, **values: Any) -> UpstreamSettings:
        """Settings with the dialect's defaults, overridden by explicit values."""
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {sorted(DIALECTS)}")
        return cls(dialect=dialect, **{**DIALECTS[dialect], **values})

    @property
    def completions_url(self) -> str:
        base = self.base_url.rstrip("/")
        return f"{base}/completions" if base.endswith("/v1") else f"{base}/v1/completions"


class UpstreamHTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"upstream answered {status}: {message}")
        self.status = status


REFUSAL_STATUSES = frozenset({400, 413, 422})


def retryable_status(status: int) -> bool:
    return status >= 500 or status in (408, 429)


def build_body(
    request: EngineRequest, s: UpstreamSettings, tokenizer: HFTokenizer, model: str
) -> dict[str, Any]:
    """The JSON body of the upstream completions request."""
    sp = request.sampling
    ids = request.prompt_token_ids
    room = s.max_model_len - len(ids)
    if not ids or room < 1:
        raise EngineError(f"prompt of {len(ids)} tokens does not fit max_model_len="
                          f"{s.max_model_len}", refused=True)
    if min(ids) < 0 or max(ids) >= tokenizer.vocab_size:
        raise EngineError("prompt has token ids outside the vocabulary", refused=True)
    prompt: Any = (list(request.prompt_token_ids) if s.prompt_format == "token_ids"
                   else tokenizer.decode(list(request.prompt_token_ids),
                                         skip_special_tokens=False))
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "stream": True,
        "max_tokens": max(1, min(sp.max_tokens, room)),
        "temperature": sp.temperature, "top_p": sp.top_p,
    }
    if sp.seed is not None:
        body["seed"] = sp.seed
    if sp.stop:
        body["stop"] = list(sp.stop)
    if s.include_usage:
        body["stream_options"] = {"include_usage": True}
    if s.send_cache_salt:
        body["cache_salt"] = request.cache_salt
    if s.return_token_ids:
        body["return_token_ids"] = True
    if s.vllm_sampling:
        if sp.stop_token_ids:
            body["stop_token_ids"] = list(sp.stop_token_ids)
        if sp.ignore_eos:
            body["ignore_eos"] = True
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(sp, name):
            body[name] = getattr(sp, name)
    if sp.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in sp.logit_bias}
    if s.vllm_sampling:
        if sp.repetition_penalty != 1.0:
            body["repetition_penalty"] = sp.repetition_penalty
        if sp.min_tokens:
            body["min_tokens"] = sp.min_tokens
        if not sp.skip_special_tokens:
            body["skip_special_tokens"] = False
        # Constrained decoding passes through as vLLM's structured outputs (length-bounded
        # strings rewritten so the grammar admits valid JSON only: workers.engine.structured).
        if sp.json_schema is not None:
            body["structured_outputs"] = {"json": for_vllm(json.loads(sp.json_schema))}
        elif sp.json_object:
            body["structured_outputs"] = {"json_object": True}
    if sp.logprobs is not None:
        # The completions endpoint's logprobs: the sampled token's and the top k.
        body["logprobs"] = sp.logprobs
        if s.dialect == "vllm":
            # Tokens as "token_id:N": exact ids, whatever the bytes of the token.
            body["return_tokens_as_token_ids"] = True
    if s.send_priority:
        body["priority"] = request.priority
    body.update(s.extra_body)
    return body


def _token_id(token: str, tokenizer: HFTokenizer) -> int | None:
    """An upstream's token string as an id: vLLM's exact "token_id:N", else the one id the
    gateway's tokenizer makes of the text (llama.cpp sends token text); None when it makes
    several (bytes of a split character), which cannot be named by one id."""
    if token.startswith("token_id:"):
        try:
            return int(token[len("token_id:"):])
        except ValueError:
            return None
    ids = tokenizer.encode(token)
    return ids[0] if len(ids) == 1 else None


def upstream_logprobs(lp: dict[str, Any], ids: list[int], k: int,
                      tokenizer: HFTokenizer) -> tuple[TokenLogprob, ...]:
    """A completions chunk's ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``)
    as ours: one entry per token, its id (the chunk's own id where the upstream sent ids),
    its logprob, and the top k alternatives by logprob."""
    tokens = lp.get("tokens") or []
    values = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    out = []
    for i, token in enumerate(tokens):
        tid = _token_id(str(token), tokenizer)
        if tid is None and len(ids) == len(tokens):
            tid = ids[i]
        if tid is None:
            continue
        value = values[i] if i < len(values) and values[i] is not None else 0.0
        alternatives = []
        for alt, alt_lp in ((tops[i] if i < len(tops) else None) or {}).items():
            alt_id = _token_id(str(alt), tokenizer)
            if alt_id is not None and alt_lp is not None:
                alternatives.append((alt_id, max(float(alt_lp), -9999.0)))
        alternatives.sort(key=lambda a: -a[1])
        out.append(TokenLogprob(tid, max(float(value), -9999.0), tuple(alternatives[:k])))
    return tuple(out)


class _Tally:
    """What one request has streamed, and its usage once the upstream is done."""

    def __init__(self, request: EngineRequest, max_tokens: int) -> None:
        self.top_k = request.sampling.logprobs  # None: no logprobs asked for
        self.prompt = len(request.prompt_token_ids)
        self.max_tokens = max_tokens
        self.ids = 0
        self.ids_known = True  # every chunk so far carried its token ids
        self.text: list[str] = []
        self.chunks = 0  # chunks with text (llama.cpp streams one per token)
        self.reported: dict[str, Any] | None = None

    def add(self, text: str, ids: list[int] | None) -> None:
        self.text.append(text)
        self.chunks += bool(text)
        if ids is None:
            self.ids_known = self.ids_known and not text
        else:
            self.ids += len(ids)

    def counted(self, tokenizer: HFTokenizer, reason: str | None) -> int:
        if self.ids_known:
            return self.ids
        if reason == FinishReason.LENGTH:
            return self.max_tokens  # the engine stopped because it generated exactly that many
        # Text only: re-encoding merges tokens the model emitted apart, and a chunk can hold
        # two tokens (a character split over bytes); both undercount, so take the larger.
        return max(len(tokenizer.encode("".join(self.text))), self.chunks)

    def usage(self, tokenizer: HFTokenizer, reason: str | None) -> Usage:
        counted = self.counted(tokenizer, reason)
        r = self.reported
        if not r:
            return Usage(self.prompt, 0, counted)
        output = int(r.get("completion_tokens", counted))
        prompt = int(r.get("prompt_tokens", self.prompt))
        details = r.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        if output != counted or prompt != self.prompt:
            # The upstream's count wins (it ran the model); a gap means tokenizers differ.
            # Per request when it happens at all: one line a minute, every one counted.
            USAGE_DIFFERS.warning("upstream usage %s/%s differs from the gateway's %s/%s",
                                  prompt, output, self.prompt, counted)
        return Usage(prompt, cached, output)

    def partial(self, tokenizer: HFTokenizer) -> Usage:
        return Usage(self.prompt, 0, self.counted(tokenizer, None))


class UpstreamEngine(Engine):
    def __init__(
        self,
        settings: UpstreamSettings,
        tokenizer_path: str | None = None,
        catalog: AdapterCatalog | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.catalog = catalog or AdapterCatalog()
        self._tok = load_tokenizer(tokenizer_path or None)
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        # Streamed completions go through the lean client (workers.engine.upstream_http);
        # httpx serves embeddings, and everything when a test injects its transport.
        self._http: UpstreamHTTP | None = None
        self._streams = PumpedStreams()

    @property
    def tokenizer(self) -> HFTokenizer:
        return self._tok

    async def start(self) -> None:
        if self._client is not None:
            return
        s = self.settings
        headers = {}
        if s.api_key_env:
            key = os.environ.get(s.api_key_env)
            if not key:
                raise EngineError(f"environment variable {s.api_key_env} is not set",
                                  retryable=False)
            headers["Authorization"] = f"Bearer {key}"
        # Reads are bounded by first-byte / idle deadlines per chunk (below), not by httpx.
        timeout = httpx.Timeout(connect=s.connect_timeout_s, read=None, write=s.idle_timeout_s,
                                pool=s.first_byte_timeout_s)
        limits = httpx.Limits(max_connections=s.max_connections,
                              max_keepalive_connections=s.max_connections)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers,
                                         transport=self._transport)
        if self._transport is None and not proxied(s.completions_url):
            self._http = UpstreamHTTP(s.completions_url, headers=headers_of(headers),
                                      max_connections=s.max_connections,
                                      connect_timeout_s=s.connect_timeout_s)

    async def stop(self) -> None:
        for rid in list(self._streams):
            await self.abort(rid)
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    def _model_for(self, request: EngineRequest) -> str:
        if not request.adapter:
            return self.settings.model
        try:
            adapter = self.catalog.for_request(request.adapter, request.cache_salt)
        except AdapterNotFound:
            raise EngineError(f"The model `{request.adapter}` does not exist.",
                              retryable=False) from None
        return adapter.upstream_model or adapter.engine_name

    def _prepare(self, request: EngineRequest) -> tuple[dict[str, Any], _Tally]:
        if not request.cache_salt:
            raise EngineError("request has no cache salt (I1)", retryable=False)
        body = build_body(request, self.settings, self._tok, self._model_for(request))
        if self._client is None:
            raise EngineError("the upstream engine is not started", retryable=True)
        return body, _Tally(request, body["max_tokens"])

    async def generate(self, request: EngineRequest) -> AsyncGenerator[TokenDelta, None]:
        body, tally = self._prepare(request)
        # aclosing: a consumer that stops early closes the relay now, which cancels the pump.
        relay = self._streams.relay(request.request_id,
                                    lambda stream: self._pump(body, tally, stream))
        async with contextlib.aclosing(relay) as deltas:
            async for delta in deltas:
                yield delta

    async def stream(self, request: EngineRequest,
                     on_delta: Callable[[TokenDelta], None]) -> TokenDelta | None:
        """The worker's call: each chunk's delta goes to ``on_delta`` from the task reading the
        upstream, with no queue and no generator between (``generate`` relays through both:
        a task switch per token per stream, which was a fifth of the worker's CPU)."""
        body, tally = self._prepare(request)
        rid = request.request_id
        if rid in self._streams:
            raise EngineError(f"request {rid} is already running", retryable=False)
        stream = self._streams[rid] = PumpedStream()
        task = stream.task = asyncio.get_running_loop().create_task(
            self._pump_to(body, tally, stream, on_delta))
        try:
            # wait(), not await: the caller's cancel must reach here, not only the task.
            await asyncio.wait([task])
        except asyncio.CancelledError:
            await self._streams.abort(rid)
            raise
        finally:
            self._streams.pop(rid, None)
        last: TokenDelta = task.result()  # the last delta (an abort's too), or the EngineError
        on_delta(last)
        return last

    async def _pump_to(self, body: dict[str, Any], tally: _Tally, stream: PumpedStream,
                       on_delta: Callable[[TokenDelta], None]) -> TokenDelta:
        try:
            reason = await self._relay(body, tally, on_delta)
            last = TokenDelta([], "", reason, tally.usage(self._tok, reason))
        except asyncio.CancelledError:  # abort(): the request ends with what it streamed
            last = TokenDelta([], "", FinishReason.ABORT, tally.partial(self._tok))
        except Exception as exc:
            if not stream.aborting:
                raise self._error(exc, tally) from None
            # Closing the connection for the abort raised instead: still the abort.
            last = TokenDelta([], "", FinishReason.ABORT, tally.partial(self._tok))
        finally:
            stream.done = True
        return last

    async def _pump(self, body: dict[str, Any], tally: _Tally, stream: PumpedStream) -> None:
        put = stream.queue.put_nowait
        try:
            reason = await self._relay(body, tally, put)
            put(TokenDelta([], "", reason, tally.usage(self._tok, reason)))
        except asyncio.CancelledError:
            put(TokenDelta([], "", FinishReason.ABORT, tally.partial(self._tok)))
            raise
        except Exception as exc:
            # Raised while the connection closed for an abort: still the abort.
            put(TokenDelta([], "", FinishReason.ABORT, tally.partial(self._tok))
                if stream.aborting else self._error(exc, tally))
        finally:
            stream.done = True

    async def _relay(self, body: dict[str, Any], tally: _Tally, put: Any) -> str:
        """Stream the upstream response into deltas; returns the finish reason.

        Server-sent events are split by hand on the raw bytes (``data:`` lines, events
        ended by a blank line): httpx's text and line decoders cost more per token than the
        JSON parse of the chunk itself."""
        assert self._client is not None
        s = self.settings
        reason: str | None = None
        async with contextlib.AsyncExitStack() as stack:
            async with asyncio.timeout(s.first_byte_timeout_s):
                response: Any = await stack.enter_async_context(self._post(body))
                if response.status_code != 200:
                    raise UpstreamHTTPError(response.status_code, await _error_text(response))
            chunks = response.aiter_bytes()
            deadline = s.first_byte_timeout_s
            sse = SSEData()
            done = False
            while not done:
                async with asyncio.timeout(deadline):
                    raw = await anext(chunks, None)
                deadline = s.idle_timeout_s
                for data in sse.feed(raw) if raw is not None else sse.close():
                    if data == b"[DONE]":
                        done = True
                        break
                    reason = self._chunk(json.loads(data), tally, put) or reason
                done = done or raw is None
        if reason is None:
            raise ConnectionError("the upstream closed the stream before finishing")
        return reason

    def _post(self, body: dict[str, Any]) -> contextlib.AbstractAsyncContextManager[Any]:
        """The streamed POST of a completion: the lean client's, or httpx's (tests)."""
        if self._http is not None:
            return self._http.post(self._path, json.dumps(body).encode())
        assert self._client is not None
        return self._client.stream("POST", self.settings.completions_url, json=body)

    @property
    def _path(self) -> str:
        url = urlsplit(self.settings.completions_url)
        return url.path + (f"?{url.query}" if url.query else "")

    def _chunk(self, chunk: dict[str, Any], tally: _Tally, put: Any) -> str | None:
        if "error" in chunk:  # vLLM reports a failure mid-stream as an error event
            err = chunk["error"] or {}
            raise UpstreamHTTPError(int(err.get("code") or 500), str(err.get("message", err)))
        if chunk.get("usage"):
            tally.reported = chunk["usage"]
        reason = None
        for choice in chunk.get("choices") or []:
            text = choice.get("text") or ""
            ids = choice.get("token_ids")
            tally.add(text, ids)
            if ids is None and text:
                # No ids on the wire (llama.cpp): the tokenizer's ids for the chunk, so the
                # stream still counts tokens; the final usage is what settles the request.
                ids = self._tok.encode(text)
            token_ids = list(ids or ())
            logprobs = (upstream_logprobs(choice["logprobs"], token_ids, tally.top_k, self._tok)
                        if tally.top_k is not None and choice.get("logprobs") else None)
            if text or token_ids or logprobs:
                put(TokenDelta(token_ids, text, logprobs=logprobs))
            if choice.get("finish_reason"):
                reason = _FINISH.get(choice["finish_reason"], FinishReason.STOP)
        return reason

    def _error(self, exc: Exception, tally: _Tally) -> EngineError:
        usage = tally.partial(self._tok)
        if isinstance(exc, UpstreamHTTPError):
            # A 4xx before any output is the upstream refusing this request (its own context
            # window, say): the client's 400, not a server error.
            refused = exc.status in REFUSAL_STATUSES and not (usage and usage.output_tokens)
            return EngineError(str(exc)[:500], retryable=retryable_status(exc.status),
                               usage=usage, refused=refused)
        if isinstance(exc, TimeoutError | httpx.TimeoutException):
            return EngineError("the upstream timed out", retryable=True, usage=usage)
        if isinstance(exc, httpx.TransportError | ConnectionError | OSError):
            return EngineError(f"the upstream is unreachable: {type(exc).__name__}: {exc}",
                               retryable=True, usage=usage)
        log.exception("upstream relay failed")
        return EngineError(f"bad upstream response: {type(exc).__name__}: {exc}",
                           retryable=True, usage=usage)

    async def embed(self, request_id: str, prompts: list[list[int]],
                    dimensions: int | None = None) -> list[list[float]]:
        """Pass-through to the upstream's ``/v1/embeddings`` (token ids for the vllm dialect,
        text otherwise), vectors as floats (the gateway encodes base64 itself)."""
        if self._client is None:
            raise EngineError("the upstream engine is not started", retryable=True)
        s = self.settings
        if dimensions is not None and s.dialect == "llama_cpp":
            # llama.cpp's server ignores `dimensions` and answers full width: refused, not
            # silently a vector of another size.
            raise dimensions_refused(dimensions,
                                     "its server (llama.cpp) cannot shorten embeddings")
        inputs: list[Any] = [list(p) if s.prompt_format == "token_ids"
                             else self._tok.decode(list(p)) for p in prompts]
        body: dict[str, Any] = {"model": s.model, "input": inputs, "encoding_format": "float"}
        if dimensions is not None:
            body["dimensions"] = dimensions
        base = s.base_url.rstrip("/")
        url = f"{base}/embeddings" if base.endswith("/v1") else f"{base}/v1/embeddings"
        try:
            async with asyncio.timeout(s.first_byte_timeout_s):
                response = await self._client.post(url, json=body)
            if response.status_code != 200:
                raise UpstreamHTTPError(response.status_code, response.text[:500])
            data = sorted(response.json()["data"], key=lambda d: d["index"])
            vectors = [d["embedding"] for d in data]
        except UpstreamHTTPError as exc:
            # The upstream turning the input down (its context window, a `dimensions` it
            # cannot honour) is the client's 400, as for generation.
            raise EngineError(str(exc)[:500], retryable=retryable_status(exc.status),
                              refused=exc.status in REFUSAL_STATUSES) from None
        except (TimeoutError, httpx.HTTPError, OSError, KeyError, ValueError,
                TypeError) as exc:
            raise EngineError(f"upstream embeddings failed: {type(exc).__name__}",
                              retryable=True) from None
        return _check_vectors(vectors, len(prompts), dimensions)

    async def abort(self, request_id: str) -> None:
        await self._streams.abort(request_id)

    def load(self) -> EngineLoad:
        # The upstream's own queue and KV cache are not visible from here; what this worker
        # has in flight is.
        n = len(self._streams)
        return EngineLoad(running=n, waiting=0, max_running=self.settings.max_connections,
                          kv_tokens_used=0, kv_tokens_total=0)


def _check_vectors(vectors: list[Any], count: int, dimensions: int | None) -> list[list[float]]:
    """The upstream's vectors as floats, one flat vector per input of the asked width.

    A causal LM served without a pooling type makes llama.cpp's server answer one vector per
    *token* (a list of lists): a misconfigured upstream, not a transient fault, so not retried.
    """
    if len(vectors) != count:
        raise EngineError(f"the upstream returned {len(vectors)} embeddings for {count} inputs",
                          retryable=False)
    if any(not isinstance(v, list) or not v or isinstance(v[0], list) for v in vectors):
        raise EngineError("the upstream returned per-token embeddings, not one vector per "
                          "input: serve an embedding model (a pooling type set)", retryable=False)
    if dimensions is not None and any(len(v) != dimensions for v in vectors):
        raise dimensions_refused(dimensions, "its server answered another width")
    try:
        return [[float(x) for x in v] for v in vectors]
    except (TypeError, ValueError):
        raise EngineError("bad upstream embeddings: not numbers", retryable=False) from None


class SSEData:
    """The ``data:`` payloads of a server-sent event stream, fed raw bytes as they arrive.

    Each ``data:`` line is one payload, as ``aiter_lines`` read it before: OpenAI-compatible
    servers send one JSON object per line. Comments, blank lines, ``event:`` and ``id:`` lines
    are skipped; lines end with LF or CRLF (llama.cpp's server sends CRLF)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, raw: bytes) -> list[bytes]:
        *lines, self._buf = (self._buf + raw).split(b"\n") if self._buf else raw.split(b"\n")
        return [line[5:].strip() for line in lines if line.startswith(b"data:")]

    def close(self) -> list[bytes]:
        """A last line the stream ended without a newline."""
        line, self._buf = self._buf, b""
        return [line[5:].strip()] if line.startswith(b"data:") else []


def proxied(url: str) -> bool:
    """Whether the environment sends ``url`` through a proxy (HTTP(S)_PROXY, not bypassed by
    NO_PROXY): httpx honours that, the lean client does not, so such an upstream keeps httpx."""
    scheme, host = urlsplit(url).scheme, urlsplit(url).hostname or ""
    return bool(urllib.request.getproxies().get(scheme)) and not urllib.request.proxy_bypass(host)


async def _error_text(response: Any) -> str:
    """An error response's message (either client's response: both have ``aread``)."""
    raw: bytes = (await response.aread())[:2000]
    try:
        err = json.loads(raw)
        if isinstance(err, dict):
            inner = err.get("error", err)
            if isinstance(inner, dict):
                return str(inner.get("message") or inner.get("detail") or inner)
            return str(inner)
    except ValueError:
        pass
    return raw.decode("utf-8", "replace")

