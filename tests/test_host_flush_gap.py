"""The engine host's step batches under a stream of single deltas (workers.host, FLUSH_GAP_S).

A unit test of ``workers.host`` alone, with the batch write replaced by a recorder: a delta
after a quiet gap goes out at once; deltas of any streams that arrive within the gap after a
batch share the next batch, each stream's texts joined in order (one relay entry each). The gap
is large here (0.2 s) so the timing holds on a loaded machine.
"""

from __future__ import annotations

import asyncio
from typing import Any

from workers.engine.registry import EngineSpec
from workers.engine.simulated import SimConfig, SimulatedEngine
from workers.host import EngineHost, _Running

GAP = 0.2


def test_deltas_within_the_gap_share_one_batch_and_a_lone_delta_goes_at_once() -> None:
    async def main() -> list[tuple[float, dict[str, Any]]]:
        host = EngineHost(EngineSpec("gap"), SimulatedEngine(SimConfig()), "gap-w",
                          flush_gap_s=GAP)
        loop = asyncio.get_running_loop()
        host._loop, host._flush_needed = loop, asyncio.Event()
        sent: list[tuple[float, dict[str, Any]]] = []

        async def record() -> None:
            batch, host._batch = host._batch, type(host._batch)(pool="gap")
            if batch:
                sent.append((loop.time(), {rid: ("".join(t), n, before, index)
                                           for rid, (t, n, before, index) in
                                           batch.tokens.items()}))

        host._flush_once = record  # type: ignore[method-assign]
        a, b = _Running("a", 1), _Running("b", 1)
        flusher = asyncio.create_task(host._flusher())
        t0 = loop.time()
        host._relay(a, "A0", 1, first=True)  # quiet before: at once
        await asyncio.sleep(0.02)
        for i in range(1, 4):  # within the gap after that batch: all in the next one
            host._relay(a, f"A{i}", 1, first=False)
            host._relay(b, f"B{i}", 1, first=i == 1)
            await asyncio.sleep(0.01)
        await asyncio.sleep(GAP * 1.5)
        flusher.cancel()
        return [(at - t0, batch) for at, batch in sent]

    sent = asyncio.run(main())
    assert len(sent) == 2, sent
    (first_at, first), (second_at, second) = sent
    assert first_at < GAP / 2 and first == {"a": ("A0", 1, 0, 1)}
    assert second_at - first_at >= GAP * 0.9
    # One entry per stream, its texts in order; `before` is what earlier batches relayed and
    # the index counts the stream's entries (its id, relay_step.lua D1).
    assert second == {"a": ("A1A2A3", 3, 1, 2), "b": ("B1B2B3", 3, 0, 1)}
