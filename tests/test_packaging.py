"""pyproject.toml: metadata current tools accept without warnings, and pins where we rely on
another project's internals."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())


def _requirement(name: str) -> Requirement:
    found = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    return next(r for r in found if r.name == name)


def test_license_is_an_spdx_expression_with_a_setuptools_that_reads_it():
    # A table ({text = ...}) is deprecated: setuptools warns on every build and will refuse it.
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    setuptools = next(Requirement(r) for r in PYPROJECT["build-system"]["requires"]
                      if r.startswith("setuptools"))
    assert not setuptools.specifier.contains("76.9") and setuptools.specifier.contains("77.0")


def test_uvicorn_is_pinned_to_the_minor_its_private_protocol_class_was_checked_against():
    """gateway/httpproto.py subclasses uvicorn's HttpToolsProtocol (not public API)."""
    spec = _requirement("uvicorn").specifier
    installed = Version(version("uvicorn"))
    assert spec.contains(installed)
    next_minor = f"{installed.major}.{installed.minor + 1}.0"
    assert not spec.contains(next_minor) and not spec.contains(
        f"{installed.major}.{installed.minor - 1}.99")
