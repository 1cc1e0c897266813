"""``WFQ_POLICY``: the order the gateway enqueues in (bench/http_fairness.py's FIFO baseline)."""

from __future__ import annotations

import asyncio

from serving import wfq


async def _policy() -> str:
    return wfq.for_loop().policy  # one AsyncWfq per event loop, built on first use


def test_the_gateway_enqueues_under_the_configured_policy(settings) -> None:
    assert asyncio.run(_policy()) == "wfq"  # the default
    settings.WFQ_POLICY = "fifo"
    assert asyncio.run(_policy()) == "fifo"  # a new loop reads the setting again

