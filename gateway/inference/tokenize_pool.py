"""Big prompts are tokenized in a process pool, never on (or beside) the serving event loop.

A thread does not help: the tokenizer holds the GIL for the whole call, so the event loop that
relays every other tenant's stream waits as long as the tokenizer runs (the review measured a
14.7 s freeze of another stream behind three 3.5 MB prompts). A process does not share the
GIL; the serving process only pickles the text out and a list of ids (at most the model's
window, see ``admission.tokenize``) back.

The pool is created on first use (``spawn``: a forked copy of a threaded, event-looped process
is unsafe) with ``TOKENIZE_PROCESSES`` processes per gateway process; requests beyond that
queue for a process, so big prompts wait on each other, not on the loop. A pool whose process
died is replaced once per call.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from django.conf import settings

from serving.prompt_encoding import encode_prompt

_lock = threading.Lock()
_pool: ProcessPoolExecutor | None = None


def _executor(replace: ProcessPoolExecutor | None = None) -> ProcessPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool is replace:
            if replace is not None:
                replace.shutdown(wait=False, cancel_futures=True)
            _pool = ProcessPoolExecutor(
                max_workers=settings.TOKENIZE_PROCESSES,
                mp_context=multiprocessing.get_context("spawn"))
        return _pool


async def encode(kind: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                 prompt: str | tuple[int, ...], tokenizer_path: str | None) -> list[int]:
    """``serving.prompt_encoding.encode_prompt`` in another process (its errors re-raised)."""
    loop = asyncio.get_running_loop()
    pool = _executor()
    try:
        return await loop.run_in_executor(pool, encode_prompt, kind, messages, tools, prompt,
                                          tokenizer_path)
    except BrokenProcessPool:
        pool = _executor(replace=pool)
        return await loop.run_in_executor(pool, encode_prompt, kind, messages, tools, prompt,
                                          tokenizer_path)
