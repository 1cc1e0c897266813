"""The soak (bench/soak.py), short: 20 tenants of every class, ~150 concurrent streams, 18 s.

Runs the bench script itself on this test's database and Redis; it exits non-zero when a check
fails (leaked slots, a lost or wrong usage record, a process growing past its RSS bound).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import procs

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


def test_short_soak(redis_client) -> None:
    done = subprocess.run(
        [sys.executable, "bench/soak.py", "--minutes", "0.3", "--tenants", "20",
         "--streams", "150", "--warmup", "5", "--sample", "2", "--rss-bound", "60"],
        cwd=procs.ROOT, env=procs.child_env(), capture_output=True, text=True, timeout=120)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "RESULT: OK" in done.stdout
    assert "failed 0 " in done.stdout  # every admitted stream completed
    assert "429 0," not in done.stdout  # the noisy tenant met its own limit
