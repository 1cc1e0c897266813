"""The engine interface every backend implements (simulated, vLLM, OpenAI-compatible upstream).

A worker process hosts one engine and feeds it requests the WFQ dispatcher picked. All requests
in flight share the engine so they batch together. The interface mirrors what vLLM's AsyncLLM
offers (generate as an async iterator of deltas, abort by id, a tokenizer), so the vLLM backend
is a thin adapter and the simulated engine is held to the same contract.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Protocol

# Part of the wire format between gateway and worker; re-exported for the engines.
from serving.wire import FinishReason, SamplingParams

__all__ = [
    "Engine", "EngineError", "EngineLoad", "EngineRequest", "FinishReason", "SamplingParams",
    "TokenDelta", "TokenLogprob", "Tokenizer", "Usage",
]


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability and the top alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # HMAC of the tenant under a server secret: prefix-cache blocks are shared only within one
    # salt, so one tenant can never hit (or time) another's cached prefix (I1).
    cache_salt: str
    adapter: str | None = None
    priority: int = 0  # lower runs first, as in vLLM's priority scheduling


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TokenDelta:
    """New output since the last delta. ``finish_reason`` and ``usage`` are set on the last one."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    # One per token id, when the request asked for logprobs.
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    max_running: int
    kv_tokens_used: int
    kv_tokens_total: int
    extra: dict[str, float] = field(default_factory=dict)


class Tokenizer(Protocol):
    eos_token_id: int | None
    # Ids at or above it are not tokens: the worker refuses them before the engine sees them.
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...


class EngineError(RuntimeError):
    """The engine failed a request. ``retryable`` says whether the client may try again.

    ``refused``: the engine turned the request down before doing any work, because of the
    request itself (a prompt beyond its context window, ids outside its vocabulary). The client
    gets a 400 and is charged nothing, as for the same refusal by the gateway.
    ``param``: the request parameter a refusal is about, where it is one.
    """

    def __init__(self, message: str, *, retryable: bool = True, usage: Usage | None = None,
                 refused: bool = False, param: str | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable and not refused
        self.refused = refused
        # The request parameter a refusal is about, named in the client's 400 as the gateway's
        # own refusals name theirs (OpenAI's error ``param``).
        self.param = param
        # What the request had used when it failed (tokens generated so far), for settlement.
        self.usage = usage


def dimensions_refused(dimensions: int, why: str) -> EngineError:
    """The refusal of a ``dimensions`` the model cannot honour (every backend words it so)."""
    return EngineError(f"The parameter `dimensions` ({dimensions}) is not supported for this "
                       f"model: {why}.", refused=True, param="dimensions")


class Engine(abc.ABC):
    """One engine instance. Implementations must be safe to call from one asyncio loop."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop after aborting whatever is still running."""

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncGenerator[TokenDelta, None]:
        """Submit and stream deltas until one carries a finish reason.

        Cancelling the consumer (closing the iterator) must abort the request, as in vLLM.
        """

    async def stream(self, request: EngineRequest,
                     on_delta: Callable[[TokenDelta], None]) -> TokenDelta | None:
        """Submit, call ``on_delta`` for every delta (the last one too), return the last one.

        ``None`` when the engine ended the stream without a finish reason (it was stopped);
        ``EngineError`` propagates; cancelling the caller aborts the request. This default
        relays ``generate()``. An engine that makes a whole step's deltas at once overrides it
        to call ``on_delta`` from inside its step, so a worker pays no task switch per token
        per sequence (``SimulatedEngine``: that switch was most of a 1,000-stream step).
        ``on_delta`` must not block or raise; it may call ``abort``.
        """
        async with aclosing(self.generate(request)) as deltas:
            async for delta in deltas:
                on_delta(delta)
                if delta.finish_reason is not None:
                    return delta
        return None

    async def embed(self, request_id: str, prompts: list[list[int]],
                    dimensions: int | None = None) -> list[list[float]]:
        """One embedding vector per prompt (an embedding model's pooled output).

        ``dimensions`` shortens the vectors where the model supports it. Engines that serve
        no embedding model keep this default. Cancelling the caller abandons the request.
        """
        raise EngineError("this engine does not serve embeddings", retryable=False)

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop the sequence within one engine step and free its KV blocks. Idempotent."""

    @abc.abstractmethod
    def load(self) -> EngineLoad: ...

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens a second this engine computes, for the dispatcher's prefill shares
        (docs/adr/0017); None when unknown (no prefill shares: slots and KV only)."""
        return None

    def failure(self) -> str | None:
        """Why this engine can serve nothing more until it is restarted (its core process
        died), or None while it is healthy. The host polls it: a failed engine is stopped and
        started again, or the worker exits to be replaced."""
        return None

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Tokenizer: ...
