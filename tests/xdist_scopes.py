"""How the live lane's modules are dealt out to pytest-xdist workers (``-p tests.xdist_scopes``).

``--dist loadfile`` hands a worker one test module at a time, so a module-scoped live system
starts once. Two things it does not know, which cost the live lane minutes at ``-n 2``:

- **vLLM's session fixtures are per worker.** ``vllm_server`` and ``vllm_engine``
  (``tests/vllm_fixtures.py``) each take 20-40 s of a 2-core machine to start, and every worker
  that meets a module using them starts its own. The modules that use real vLLM are one unit
  here (``VLLM_MODULES``), so one worker starts each engine once.
- **Order.** xdist deals the units largest first by test count; a long unit dealt last leaves
  the other worker idle at the end. Here the units measured slowest go first (longest
  processing time first), then the rest as xdist would order them.

Only ``--dist loadfile`` changes (the unit lane steals by test: ``--dist worksteal``).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import PurePosixPath
from typing import Any

import pytest
from xdist.scheduler import LoadFileScheduling

VLLM_UNIT = "vllm"
VLLM_MODULES = frozenset({
    "test_api_surface_vllm.py", "test_api_surface_vllm_e2e.py", "test_engine_conformance.py",
    "test_upstream_backend.py", "test_vllm_backend.py", "test_vllm_e2e.py",
})
# Seconds per unit in one live-lane run at -n 3 on the 2-core machine (wall per module, summed
# over its tests; session 12, Chromium installed). Only the order matters: a stale figure costs
# some idle tail, never a wrong result. Units not named go after these.
MEASURED_S = {
    VLLM_UNIT: 168, "test_browser.py": 110, "test_routes_live.py": 88,
    "test_serve_supervisor.py": 70, "test_faults_soak.py": 52, "test_inference_live.py": 45,
    "test_fuzz_schemathesis.py": 44, "test_transport.py": 38, "test_faults_sentinel.py": 37,
    "test_bench_fairness.py": 34, "test_faults_redis.py": 25, "test_worker_integration.py": 24,
    "test_hostile_live.py": 23, "test_api_surface_live.py": 17,
}


def unit_of(nodeid: str) -> str:
    """The unit a test is dealt in: its module, or the vLLM unit."""
    path = nodeid.split("::", 1)[0]
    return VLLM_UNIT if PurePosixPath(path).name in VLLM_MODULES else path


def unit_cost(unit: str, tests: int) -> tuple[int, int]:
    """The dealing order's key: measured slowest first, then by number of tests, most first
    (xdist's own order)."""
    return -MEASURED_S.get(PurePosixPath(unit).name, 0), -tests


class MeasuredFileScheduling(LoadFileScheduling):
    """``loadfile``, with the vLLM modules as one unit and the units dealt by ``unit_cost``."""

    _ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node: Any) -> None:
        # schedule() has built the queue (in xdist's order) by the first deal: reorder it once.
        # The workers' collections are left as they are: xdist names tests by their index there.
        if not self._ordered:
            self._ordered = True
            self.workqueue = OrderedDict(sorted(
                self.workqueue.items(), key=lambda unit: unit_cost(unit[0], len(unit[1]))))
        super()._assign_work_unit(node)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") == "loadfile":
        return MeasuredFileScheduling(config, log)
    return None
