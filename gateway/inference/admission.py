"""Count the prompt with the engine's tokenizer and check it against the tenant's limits.

This is the part of admission that needs no shared state: it runs before anything is charged,
so every refusal here is free. Counting uses the tokenizer the engine itself loads (the chat
template applied), so the gateway's charge and the engine's count agree (design: "tokenizer
mismatch"); the engine's count still wins at settlement.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.inference.errors import ApiError, context_length_exceeded, invalid_request
from gateway.inference.pools import ModelInfo
from gateway.inference.requests import InferenceRequest
from tenants.limits import Limits
from workers.tokenization import ChatTemplateError, load_tokenizer

# Above this many characters, tokenizing moves off the event loop so one big prompt does not
# stall every other stream this process is relaying.
INLINE_TOKENIZE_CHARS = 20_000


@dataclass(frozen=True)
class Sized:
    prompt_token_ids: list[int]
    max_tokens: int
    context_limit: int


def _encode(req: InferenceRequest, model: ModelInfo) -> list[int]:
    tokenizer = load_tokenizer(model.tokenizer_path)
    if req.kind == "chat":
        try:
            # Tool definitions are rendered into the prompt by the template, so they are
            # counted and charged as the prompt tokens they are.
            return tokenizer.apply_chat_template(list(req.messages), tools=list(req.tools))
        except (ChatTemplateError, TypeError) as exc:
            raise invalid_request(f"The messages do not fit this model's chat template: {exc}",
                                  param="messages", code="invalid_value") from None
    if isinstance(req.prompt, tuple):
        vocab = tokenizer.vocab_size
        if any(t >= vocab for t in req.prompt):
            raise invalid_request(f"Token ids must be below the vocabulary size ({vocab}).",
                                  param="prompt", code="invalid_value")
        return list(req.prompt)
    return tokenizer.encode(req.prompt)


_loaded: set[str | None] = set()


async def tokenize(req: InferenceRequest, model: ModelInfo) -> list[int]:
    size = req.text_size
    if size > INLINE_TOKENIZE_CHARS or model.tokenizer_path not in _loaded:
        # Big prompts, and the first use of a tokenizer (loading it reads and indexes its
        # files), run in a thread.
        ids = await asyncio.to_thread(_encode, req, model)
        _loaded.add(model.tokenizer_path)
        return ids
    return _encode(req, model)


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
