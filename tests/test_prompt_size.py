"""Security review 3, N3: big prompts are refused by size before tokenizing, tokenized off the
serving event loop (a process pool: a thread holds the GIL), include tool-call arguments in
their size, and repeated refusals for size turn into the tenant's 429s."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.inference import oversize
from gateway.inference.errors import ApiError
from gateway.inference.pools import ModelInfo
from gateway.inference.requests import InferenceRequest, parse
from gateway.inference.sizing import size_cap, tokenize
from serving.prompt_encoding import encode_prompt

SMALL = ModelInfo("m", None, 2048, 0)
WIDE = ModelInfo("wide", None, 10_000_000, 0)  # a window nothing is refused by size for


def chat(content: str, **fields: Any) -> InferenceRequest:
    data = {"model": "m", "messages": [{"role": "user", "content": content}], **fields}
    return parse(json.dumps(data).encode(), "chat")


def test_text_size_counts_tool_call_arguments() -> None:
    args = json.dumps({"city": "x" * 50_000})
    req = parse(json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}).encode(), "chat")
    assert req.text_size > 50_000


def test_the_size_cap_is_a_lower_bound_of_the_token_count() -> None:
    """No prompt under the cap is refused that would fit: the cap allows the longest token for
    every position of the window."""
    from serving.prompt_encoding import max_token_chars
    from serving.tokenization import load_tokenizer

    longest = max(load_tokenizer(None).vocab_pieces(), key=len)
    assert max_token_chars(None) == len(longest)
    assert size_cap(SMALL) >= SMALL.max_model_len * len(longest)


@pytest.mark.parametrize("where", ["content", "tool_calls"])
def test_a_prompt_too_big_for_the_window_is_refused_before_tokenizing(where: str) -> None:
    big = "hello world " * 300_000  # 3.6 MB: ~13 s to tokenize on a loaded machine
    if where == "content":
        req = chat(big)
    else:
        req = parse(json.dumps({"model": "m", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "w", "arguments": json.dumps({"q": big})}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}]}).encode(), "chat")
    asyncio.run(tokenize(chat("warm"), SMALL))  # the tokenizer loaded
    started = time.perf_counter()
    with pytest.raises(ApiError) as info:
        asyncio.run(tokenize(req, SMALL))
    assert time.perf_counter() - started < 0.5
    assert (info.value.status, info.value.code, info.value.param) == (
        400, "prompt_too_large", "messages")


async def _largest_gap(work: Callable[[], Awaitable[Any]]) -> tuple[Any, float]:
    """Run ``work`` while a ticker measures the event loop's largest stall."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    try:
        result = await work()
    finally:
        done.set()
        await tick
    return result, max(gaps, default=0.0)


def test_big_prompts_are_tokenized_in_a_process_not_on_the_loop() -> None:
    text = "the quick brown fox jumps over the lazy dog " * 8_000  # 352 KB
    req = chat(text)
    asyncio.run(tokenize(chat("warm"), WIDE))
    asyncio.run(tokenize(req, WIDE))  # the pool's processes started and their tokenizer loaded
    expected = encode_prompt("chat", list(req.messages), [], "", None)
    started = time.perf_counter()
    inline_ids = encode_prompt("chat", list(req.messages), [], "", None)
    inline_s = time.perf_counter() - started

    async def pooled() -> list[int]:
        return await tokenize(req, WIDE)

    async def threaded() -> list[int]:
        return await asyncio.to_thread(encode_prompt, "chat", list(req.messages), [], "", None)

    ids, pool_gap = asyncio.run(_largest_gap(pooled))
    _, thread_gap = asyncio.run(_largest_gap(threaded))
    assert ids == expected == inline_ids
    print(f"tokenize {len(text)} chars: {inline_s:.3f} s inline; largest loop stall "
          f"{thread_gap:.3f} s in a thread, {pool_gap:.3f} s in the process pool")
    # A thread stalls the loop for about the whole encode (the GIL); the pool does not.
    assert pool_gap < max(0.25, inline_s / 3)


def test_repeated_size_refusals_become_429s(redis_client, settings) -> None:
    settings.OVERSIZE_REFUSALS_PER_MINUTE = 3

    async def attempt() -> int:
        try:
            async with oversize.counted(77):
                raise ApiError(400, "too big", code="prompt_too_large")
        except ApiError as exc:
            return exc.status
        return 200

    async def run() -> list[int]:
        return [await attempt() for _ in range(5)]

    assert asyncio.run(run()) == [400, 400, 400, 429, 429]
    assert 0 < redis_client.ttl(oversize._key(77)) <= oversize.WINDOW_S
    # Another tenant is not affected, and other 400s are not counted.
    assert asyncio.run(oversize.record(78)) == 1


def test_concurrent_refusals_lose_no_count(redis_client) -> None:
    async def run() -> list[int]:
        return list(await asyncio.gather(*(oversize.record(5) for _ in range(40))))

    counts = asyncio.run(run())
    assert sorted(counts) == list(range(1, 41))
    assert redis_client.ttl(oversize._key(5)) > 0
