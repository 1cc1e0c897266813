"""bench/http_fairness.py's smoke case end to end (issue 16), in well under a minute.

Runs the bench script itself on this test's database and Redis: a gateway and a pool worker as
subprocesses, three small tenants beside a 4k-token prompt flood at 3x the pool's prefill
rate for 2 s, the flood alone, and three backlogged tenants of weights 3:1:1. It checks the bench
produces its table and figures that make sense, not that the targets are met (the figures of a
4 s run on a shared machine are too noisy for that; docs/fairness.md has the real runs).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests import procs

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_fairness_bench_smoke(redis_client, tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, "bench/http_fairness.py", "--smoke", "--json", str(out)],
        cwd=procs.ROOT, env=procs.child_env(), capture_output=True, text=True, timeout=170)
    print(done.stdout[-4000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for line in ("small TTFT p95, flood 4k @3xP, no budget", "work-conserving",
                 "weights 3:1:1: worst share error", "VTC max service diff"):
        assert line in done.stdout
    assert any(v in done.stdout for v in (" met", "NOT MET"))

    run = json.loads(out.read_text())["runs"][0]["wfq"]
    alone, flood = run["small_alone"]["small"], run["flood 4000"]
    # Every small request was answered, and its first token came after it was sent.
    assert alone["failed"] == 0 and flood["small"]["failed"] == 0
    assert alone["ok"] >= 5 and flood["small"]["n"] >= 5
    assert 0 < alone["p50"] <= alone["p95"] <= alone["max"] < 30
    assert 0 < flood["small"]["p95"] < 60
    # The flood was sent at the planned rate and some of it was served.
    assert flood["flood_sent"] == round(3 * 20_000 / 4000 * 2)
    assert flood["flood_tps"] > 0
    assert run["alone"]["flood_tps"] > 0
    # Shares are fractions of what was served, and the measure of fairness is finite.
    weights = run["weights"]
    assert math.isclose(sum(weights["shares"].values()), 1.0, rel_tol=1e-9)
    assert all(0 <= s <= 1 for s in weights["shares"].values())
    assert weights["rate"] > 0 and 0 <= weights["max_diff"] < math.inf
    assert weights["failed"] == 0
    # The gateway's exported shares (igw_fair_service_share) equal the bench's own, within
    # 2 percentage points, on the same 3:1:1 backlogged run (issue 29).
    gauges = weights["gauge_shares"]
    assert set(gauges) == set(weights["shares"])
    for tenant, share in weights["shares"].items():
        assert abs(gauges[tenant] - share) <= 0.02, (tenant, gauges, weights["shares"])
