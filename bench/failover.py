"""Failover figures on real processes (issue 28): one gateway, two pools of one model each with
its own worker, and a model with an OpenAI-compatible upstream pool beside a simulated one.

Runs the scenarios of ``tests/test_routes_live.py`` (so the bench and CI run the same thing;
a throwaway ``test_*`` database, the Redis DB in ``REDIS_URL``) and prints their tables:

    SIGKILL   one pool's only worker killed under 14 streams: requests completed, client-visible
              errors before a token (must be 0), mid-stream ends, time to route around it
    503       the upstream answers 503 under 12 streams: completed, retried, attempts metered
    overhead  the router's choice per request against the single-pool choice it replaced,
              same run, same Redis
    fairness  tenants 3:1:1 backlogged over two pools: their shares

    DATABASE_URL=... REDIS_URL=... python bench/failover.py
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_routes_live.py", "-q", "-s",
         "-p", "no:cacheprovider", "-p", "no:logging", "-W", "ignore"],
        cwd=ROOT, capture_output=True, text=True)
    keep = False
    for line in done.stdout.splitlines():
        at = line.find("== ")  # pytest's progress dots may precede a table's title
        if at >= 0 and line.endswith(" ==") and not line.startswith("="):
            line, keep = line[at:], True
        elif keep and not line.startswith("  "):
            keep = False
        if keep or line.startswith("fairness over"):
            print(line)
    if done.returncode:
        print("\n".join(x for x in done.stdout.splitlines()
                        if x.startswith(("E ", "FAILED")))[:3000])
    print(f"-> {'PASS' if done.returncode == 0 else 'FAIL'} in {time.monotonic() - start:.0f} s")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
