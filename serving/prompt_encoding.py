"""A request's prompt -> token ids, in a form a worker process of a process pool can run.

Tokenizing is CPU work that holds the GIL (the Rust tokenizer does not release it for one
call), so in a thread it still stalls the event loop that relays every other stream: 3.5 MB
took 13 s on a loaded machine. The gateway therefore runs big prompts here, in a separate
process (``gateway.inference.tokenize_pool``), with only picklable arguments and results.

``max_token_chars`` gives the longest text one token of the vocabulary stands for, so a prompt
of more than ``window * max_token_chars`` characters cannot fit ``window`` tokens: the gateway
refuses it by size before tokenizing anything.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from serving.tokenization import ChatTemplateError, load_tokenizer


class PromptRefused(Exception):
    """The prompt cannot be tokenized as given; ``args``: (message, parameter)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param)
        self.message = message
        self.param = param


def encode_prompt(kind: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                  prompt: str | tuple[int, ...], tokenizer_path: str | None) -> list[int]:
    tokenizer = load_tokenizer(tokenizer_path)
    if kind == "chat":
        try:
            # Tool definitions are rendered into the prompt by the template, so they are
            # counted and charged as the prompt tokens they are.
            return tokenizer.apply_chat_template(messages, tools=tools)
        except (ChatTemplateError, TypeError) as exc:
            raise PromptRefused(f"The messages do not fit this model's chat template: {exc}",
                                "messages") from None
    if isinstance(prompt, tuple):
        vocab = getattr(tokenizer, "vocab_size", None)
        if vocab is not None and any(t >= vocab for t in prompt):
            raise PromptRefused(f"Token ids must be below the vocabulary size ({vocab}).",
                                "prompt")
        return list(prompt)
    return tokenizer.encode(prompt)


@lru_cache(maxsize=16)
def max_token_chars(tokenizer_path: str | None) -> int:
    """The most characters of text one token stands for (byte-level vocabularies spell each
    byte as one character, so this bounds bytes too); at least 1."""
    tokenizer = load_tokenizer(tokenizer_path)
    return max((len(piece) for piece in tokenizer.vocab_pieces()), default=1) or 1
