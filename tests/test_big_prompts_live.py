"""Security review 3, N3, on the real processes: three concurrent 3.5 MB prompts from one
tenant are refused for size (free, and soon 429) while another tenant's stream keeps flowing;
its largest gap between tokens stays well under a second (the review measured 14.7 s)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests import live_pool, rkeys
from tests.live_pool import HELLO, MODEL, SERVER_ENV, client, tenant_key

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]
WORKER = "bigprompt-w1"
ENV = {**SERVER_ENV, "MAX_REQUEST_BYTES": str(8_000_000), "OVERSIZE_REFUSALS_PER_MINUTE": "3"}


system, live = live_pool.fixtures(WORKER, ENV)  # the processes, and each test's wait


def _big_request(url: str, plain: str) -> httpx.Response:
    body = json.dumps({"model": MODEL, "max_tokens": 5, "messages": [
        {"role": "user", "content": "hello world " * 300_000}]})  # 3.6 MB
    return httpx.post(url + "/v1/chat/completions", content=body, timeout=60,
                      headers={"authorization": f"Bearer {plain}",
                               "content-type": "application/json"})


def test_big_prompts_do_not_stall_another_tenants_stream(live, redis_client) -> None:
    attacker_key, attacker = tenant_key()
    _, victim = tenant_key()
    stream = client(live["url"], victim).chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=600, stream=True,
        extra_body={"ignore_eos": True})
    answers: list[httpx.Response] = []
    url = live["url"]
    attackers = [threading.Thread(target=lambda: answers.append(_big_request(url, attacker)))
                 for _ in range(3)]
    gaps: list[float] = []
    last = None
    for n, _chunk in enumerate(stream):
        now = time.monotonic()
        if last is not None:
            gaps.append(now - last)
        last = now
        if n == 5:
            for t in attackers:
                t.start()
    for t in attackers:
        t.join(60)
    print(f"victim stream: {len(gaps)} gaps, largest {max(gaps):.3f} s")
    assert len(answers) == 3
    assert [a.status_code for a in answers] == [400] * 3
    assert {a.json()["error"]["code"] for a in answers} == {"prompt_too_large"}
    assert max(gaps) < 1.0
    # Refusals for size count against the tenant: the fourth within the minute is a 429, and
    # none of it was charged.
    fourth = _big_request(live["url"], attacker)
    assert fourth.status_code == 429
    assert fourth.json()["error"]["code"] == "too_many_oversized_prompts"
    assert int(fourth.headers["retry-after"]) >= 1
    assert all(r["tenant_id"] != attacker_key.tenant_id for r in rkeys.usage_records(redis_client))
