"""Checking a pool's ``backend_settings`` before it is saved.

The rules belong to the engine backends (``workers.engine.registry``), which sit above
``tenants``; the workers app registers its checker here when Django starts, so the Pool admin
can refuse a typo with an error naming the key instead of saving a pool whose worker then
fails to start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (name, backend, backend_settings, dedicated) -> None, or raises ValueError naming the key.
Checker = Callable[[str, str, dict[str, Any], bool], None]

_checkers: list[Checker] = []


def register(checker: Checker) -> None:
    if checker not in _checkers:
        _checkers.append(checker)


def check(name: str, backend: str, backend_settings: dict[str, Any], dedicated: bool) -> None:
    """Raise ValueError with a message naming the bad key; no checker registered: accept."""
    for checker in _checkers:
        checker(name, backend, backend_settings, dedicated)
