"""Fault scenarios on the real processes, one table per fault: what happened, and how fast.

Each scenario is the automated test in ``tests/test_faults_*.py`` (so the bench and CI run the
same thing); this script runs them with pytest (a throwaway ``test_*`` database and the Redis
DB in ``REDIS_URL``, flushed by the tests) and prints each scenario's table and verdict:

    worker      SIGKILL of a pool worker with 100 streams in flight (a second one lives)
    redis       Redis killed and restarted empty, 4 s and 1.5 s outages, under load
    gateway     a gateway process killed mid-stream; half the clients resume on another
    db          PostgreSQL cut through a proxy: cached credentials, buffered usage, 503 admin
    engine      engine raises / stalls / returns garbage for one request; deadlines fire
    retry       retry storms with and without an Idempotency-Key

    DATABASE_URL=... REDIS_URL=... python bench/faults.py [worker redis ...]
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("worker", "redis", "gateway", "db", "engine", "retry")
_TABLE = re.compile(r"^(== .* ==|  .*)$")


def run(name: str) -> tuple[bool, float, list[str]]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", f"tests/test_faults_{name}.py", "-q", "-s",
         "-p", "no:cacheprovider", "-p", "no:logging", "-W", "ignore"],
        cwd=ROOT, capture_output=True, text=True)
    lines, in_table = [], False
    for line in done.stdout.splitlines():
        start = line.find("== ")  # pytest's progress dots may precede a table's title
        if start >= 0 and line.endswith(" ==") and not line.startswith("="):
            line, in_table = line[start:], True
        elif in_table and not line.startswith("  "):
            in_table = False
        if in_table and _TABLE.match(line):
            lines.append(line)
    if done.returncode:
        lines += [x for x in done.stdout.splitlines() if x.startswith(("E ", "FAILED"))][:15]
    return done.returncode == 0, time.monotonic() - start, lines


def main() -> int:
    chosen = sys.argv[1:] or list(SCENARIOS)
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        sys.exit(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")
    verdicts = []
    for name in chosen:
        ok, seconds, lines = run(name)
        print("\n".join(lines) or f"== {name}: no table ==")
        print(f"  -> {'PASS' if ok else 'FAIL'} in {seconds:.0f} s\n", flush=True)
        verdicts.append(ok)
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
