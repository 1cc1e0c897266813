"""The live lane's dealing (``tests/xdist_scopes.py``, ADR 0031)."""

from __future__ import annotations

import re
from pathlib import Path

from tests import xdist_scopes as xs

TESTS = Path(__file__).resolve().parent
USES_VLLM = re.compile(r"\b(vllm_server|vllm_engine|vllm_stack|tiny_vllm|vllm_fixtures)\b")


def test_every_module_that_uses_real_vllm_is_in_the_vllm_unit_and_no_other() -> None:
    """A module missing from the unit would start its own engine on the other worker."""
    using = {path.name for path in TESTS.glob("test_*.py")
             if path.name != Path(__file__).name and USES_VLLM.search(path.read_text())}
    assert using == xs.VLLM_MODULES


def test_the_module_that_kills_the_shared_engine_core_runs_last_in_the_vllm_unit() -> None:
    """A unit's modules run in collection order (by name): test_vllm_e2e kills the engine
    core of the worker it shares with test_api_surface_vllm_e2e (``vllm_stack``) in its last
    test, so it must come after every other module of the unit."""
    assert sorted(xs.VLLM_MODULES)[-1] == "test_vllm_e2e.py"


def test_units_are_the_module_or_the_vllm_unit() -> None:
    assert xs.unit_of("tests/test_vllm_e2e.py::test_x[a::b]") == xs.VLLM_UNIT
    assert xs.unit_of("tests/test_engine_conformance.py::test_y[vllm]") == xs.VLLM_UNIT
    assert xs.unit_of("tests/test_routes_live.py::test_z") == "tests/test_routes_live.py"


def test_units_are_dealt_slowest_first_then_by_size() -> None:
    units = {"tests/test_small.py": 3, "tests/test_routes_live.py": 10, xs.VLLM_UNIT: 40,
             "tests/test_big.py": 50, "tests/test_serve_supervisor.py": 7}
    order = sorted(units, key=lambda unit: xs.unit_cost(unit, units[unit]))
    assert order == [xs.VLLM_UNIT, "tests/test_routes_live.py", "tests/test_serve_supervisor.py",
                     "tests/test_big.py", "tests/test_small.py"]
