"""Count the prompt with the engine's tokenizer and check it against the tenant's limits.

This is the part of admission that needs no shared state: it runs before anything is charged,
so every refusal here is free. Counting uses the tokenizer the engine itself loads (the chat
template applied), so the gateway's charge and the engine's count agree (design: "tokenizer
mismatch"); the engine's count still wins at settlement.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from gateway.inference import tokenize_pool
from gateway.inference.errors import ApiError, context_length_exceeded, invalid_request
from gateway.inference.pools import ModelInfo
from gateway.inference.requests import InferenceRequest
from serving.prompt_encoding import PromptRefused, encode_prompt, max_token_chars
from tenants.limits import Limits

# Above this many characters, tokenizing moves to a process pool (``tokenize_pool``) so one big
# prompt does not stall every other stream this process is relaying.
INLINE_TOKENIZE_CHARS = 20_000
# How much longer than its longest token the rendered text of a prompt may be per token: the
# text size counted before rendering is close to, not exactly, what the template renders.
SIZE_SLACK = 2


@dataclass(frozen=True)
class Sized:
    prompt_token_ids: list[int]
    max_tokens: int
    context_limit: int


def _args(req: InferenceRequest, model: ModelInfo) -> tuple[Any, ...]:
    return (req.kind, list(req.messages), list(req.tools), req.prompt, model.tokenizer_path)


def _refused(exc: PromptRefused) -> ApiError:
    return invalid_request(exc.message, param=exc.param, code="invalid_value")


def _encode(req: InferenceRequest, model: ModelInfo) -> list[int]:
    try:
        return encode_prompt(*_args(req, model))
    except PromptRefused as exc:
        raise _refused(exc) from None


_loaded: set[str | None] = set()


def size_cap(model: ModelInfo) -> int:
    """Characters of prompt text beyond which no prompt can fit the model's window."""
    return model.max_model_len * max_token_chars(model.tokenizer_path) * SIZE_SLACK


async def tokenize(req: InferenceRequest, model: ModelInfo) -> list[int]:
    """Prompt ids: refused by size before any tokenizing when the text cannot fit the model's
    window (``size_cap``), tokenized inline when small, in a process pool when big."""
    if model.tokenizer_path not in _loaded:
        # The first use of a tokenizer (loading it reads and indexes its files) runs in a
        # thread; its longest token is measured once with it.
        await asyncio.to_thread(max_token_chars, model.tokenizer_path)
        _loaded.add(model.tokenizer_path)
    size, cap = req.text_size, size_cap(model)
    if size > cap:
        param = "messages" if req.kind == "chat" else "prompt"
        raise ApiError(400, f"The prompt is too long: {size} characters cannot fit this "
                       f"model's context window of {model.max_model_len} tokens (at most "
                       f"{cap} characters).", param=param, code="prompt_too_large")
    if size <= INLINE_TOKENIZE_CHARS:
        return _encode(req, model)
    try:
        return await tokenize_pool.encode(*_args(req, model))
    except PromptRefused as exc:
        raise _refused(exc) from None


def size_request(req: InferenceRequest, prompt_ids: list[int], model: ModelInfo,
                 limits: Limits) -> Sized:
    """Check the prompt and max_tokens against the context window; fill in a missing max_tokens.

    The window is the smaller of the tenant's max context and the model's own. A prompt needs
    room for at least one output token. A missing max_tokens becomes what is left of the window,
    capped by the tenant's per-request maximum.
    """
    window = min(limits.max_context_tokens, model.max_model_len)
    prompt = len(prompt_ids)
    if prompt == 0:
        raise invalid_request("The prompt is empty.", param="prompt", code="invalid_value")
    if prompt + 1 > window:
        raise context_length_exceeded(window, prompt, req.max_tokens)
    if req.max_tokens is not None and req.max_tokens > limits.max_output_tokens:
        raise ApiError(
            400,
            f"max_tokens is too large: {req.max_tokens}. This key allows at most "
            f"{limits.max_output_tokens} completion tokens per request.",
            param="max_tokens", code="max_tokens_exceeded",
        )
    if req.max_tokens is not None and prompt + req.max_tokens > window:
        raise context_length_exceeded(window, prompt, req.max_tokens)
    max_tokens = req.max_tokens or min(window - prompt, limits.max_output_tokens)
    return Sized(prompt_ids, max_tokens, window)
