"""The suite's own settings (tests/testenv.py): what ``--unit-lane`` selects and how it
distributes, and the bytecode caches a run writes."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from tests import testenv


def _configured(markexpr: str, dist: str) -> tuple[Any, list[object]]:
    registered: list[object] = []
    config: Any = SimpleNamespace(
        option=SimpleNamespace(markexpr=markexpr, dist=dist),
        getoption=lambda name: True,  # --unit-lane given
        pluginmanager=SimpleNamespace(register=lambda plugin, name: registered.append(plugin)))
    testenv.pytest_configure(config)
    return config, registered


def test_the_unit_lane_steals_tests_instead_of_keeping_a_file_on_one_worker() -> None:
    config, registered = _configured("", "loadfile")
    assert config.option.dist == "worksteal"
    assert config.option.markexpr == testenv.UNIT_LANE
    assert [type(p) for p in registered] == [testenv._ProcessGuard]


@pytest.mark.parametrize("dist", ["no", "load", "worksteal"])
def test_the_unit_lane_leaves_any_other_distribution_as_asked(dist: str) -> None:
    config, _ = _configured("fast", dist)
    assert config.option.dist == dist
    assert config.option.markexpr == f"(fast) and {testenv.UNIT_LANE}"


def test_the_run_and_its_children_write_bytecode_caches() -> None:
    assert sys.dont_write_bytecode is False
    assert "PYTHONDONTWRITEBYTECODE" not in os.environ
