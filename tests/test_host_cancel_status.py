"""A request the worker saw cancelled settles as ``cancelled`` however its sequence then ends
(I4: the right status, once; I5: billed for the tokens generated).

A unit test of ``workers.host`` alone, the settlement replaced by a recorder: after the cancel,
the engine may end the sequence with an error (vLLM's abort raising, an engine that fails while
aborting), end it without a finish, or the stream may have lost a step batch; each is settled as
the cancel, with the engine's counts where it gave them and the delivered count otherwise.
Without a cancel the same endings stay errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from serving.settlement import Status
from workers.engine.base import (
    EngineError,
    EngineRequest,
    FinishReason,
    SamplingParams,
    TokenDelta,
    Usage,
)
from workers.engine.registry import EngineSpec
from workers.engine.simulated import SimConfig, SimulatedEngine
from workers.host import EngineHost, _Running


class EndingEngine(SimulatedEngine):
    """Streams two tokens, then ends the way the test says."""

    def __init__(self, ending: Callable[[], TokenDelta | None]) -> None:
        super().__init__(SimConfig())
        self.ending = ending

    async def stream(self, request: EngineRequest,
                     on_delta: Callable[[TokenDelta], None]) -> TokenDelta | None:
        on_delta(TokenDelta([5, 6], "ab"))
        await asyncio.sleep(0)
        return self.ending()


def settle_of(ending: Callable[[], TokenDelta | None], *, cancel: str = "",
              broken: bool = False) -> dict[str, Any]:
    host = EngineHost(EngineSpec("cancel-status"), EndingEngine(ending), "cs-w")
    host._vocab = 100
    settled: list[dict[str, Any]] = []

    async def record(rid: str, status: str, finish_reason: str | None, prompt: int | None,
                     cached: int, output: int | None, **kw: Any) -> bool:
        settled.append({"status": status, "finish": finish_reason, "prompt": prompt,
                        "cached": cached, "output": output, "code": kw["error_code"]})
        return True

    host._settle = record  # type: ignore[method-assign]
    host._relay = lambda *a, **kw: None  # type: ignore[method-assign]
    entry = _Running("r1", 10, cancel_reason=cancel, broken=broken)
    host.running["r1"] = entry
    request = EngineRequest("r1", [1, 2, 3], SamplingParams(max_tokens=8), "s")
    asyncio.run(host._generate(entry, request))
    assert len(settled) == 1
    return settled[0]


def _raise() -> TokenDelta:
    raise EngineError("vLLM failed the request: EngineGenerateError: ", usage=Usage(3, 1, 2))


@pytest.mark.parametrize("ending", [_raise, lambda: None])
def test_an_error_after_the_cancel_settles_as_the_cancel(ending: Any) -> None:
    got = settle_of(ending, cancel="client_disconnect")
    assert (got["status"], got["finish"], got["code"]) == (
        Status.CANCELLED, FinishReason.ABORT, "client_disconnect")
    if ending is _raise:  # the engine's own counts
        assert (got["prompt"], got["cached"], got["output"]) == (3, 1, 2)
    else:  # none given: the delivered count
        assert got["output"] is None


def test_without_a_cancel_the_same_endings_are_errors() -> None:
    assert settle_of(_raise)["status"] == Status.ERROR
    assert settle_of(_raise)["code"] == "engine_error"
    assert settle_of(lambda: None)["code"] == "engine_stopped"


def test_a_broken_stream_after_the_cancel_is_cancelled_and_billed_as_delivered() -> None:
    def aborted() -> TokenDelta:
        return TokenDelta([], "", FinishReason.ABORT, Usage(3, 0, 2))

    got = settle_of(aborted, cancel="client_disconnect", broken=True)
    assert (got["status"], got["code"], got["output"]) == (
        Status.CANCELLED, "client_disconnect", None)
    assert settle_of(aborted, broken=True)["code"] == "stream_broken"
    got = settle_of(aborted, cancel="client_disconnect")
    assert (got["status"], got["output"]) == (Status.CANCELLED, 2)


def test_a_finish_before_the_cancel_is_kept() -> None:
    got = settle_of(lambda: TokenDelta([], "", FinishReason.LENGTH, Usage(3, 0, 2)),
                    cancel="client_disconnect")
    assert (got["status"], got["output"]) == (Status.OK, 2)
