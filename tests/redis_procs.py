"""What every group of test-started ``redis-server`` processes shares: a scratch directory
for their files and logs, a liveness ping, the logs' tails, and a stop that leaves nothing."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import redis


class RedisProcs:
    def __init__(self, prefix: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.procs: dict[Any, subprocess.Popen[bytes]] = {}

    def _ping(self, port: int) -> bool:
        try:
            return bool(redis.Redis(port=port, socket_timeout=0.5).ping())
        except redis.RedisError:
            return False

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}"
                         for p in sorted(self.dir.glob("*.log")))

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
