"""Bad settings stop start-up with a message that names the setting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def start(**env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "DJANGO_SETTINGS_MODULE": "gateway.settings", **env}
    return subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=ROOT,
                          env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.integration
def test_good_environment_starts():
    done = start()
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name,value", [
    ("AUTH_CACHE_SECONDS", "abc"),
    ("AUTH_CACHE_SECONDS", "-1"),
    ("AUTH_CACHE_SECONDS", "nan"),
    ("DEBUG", "maybe"),
    ("DATABASE_URL", "junk"),
    ("API_KEY_PEPPERS", "1:short"),
    ("API_KEY_PEPPERS", "one:long-enough-secret-123"),
    ("API_KEY_PREFIX", "Has_Underscore"),
    ("SECRET_KEY", "too-short"),
    ("LOG_LEVEL", "LOUD"),
    ("MAX_REQUEST_BYTES", "12"),
    ("WORKER_HEARTBEAT_SECONDS", "soon"),
    ("CELLS", "not json"),
    ("CELLS", '{"eu": {"url": "https://eu.example"}}'),  # no redis_url
    ("CELL", "nowhere"),  # not one of CELLS
    ("CELL_SHARE_FLOOR", "2"),
])
@pytest.mark.integration
def test_bad_value_stops_startup_naming_the_setting(name, value):
    done = start(**{name: value})
    assert done.returncode != 0
    last_line = done.stderr.strip().splitlines()[-1]
    assert "ImproperSetting" in last_line and name in last_line, done.stderr[-500:]


@pytest.mark.integration
def test_secret_read_from_a_missing_file_names_the_setting(tmp_path):
    done = start(SECRET_KEY_FILE=str(tmp_path / "absent"))
    assert done.returncode != 0 and "SECRET_KEY_FILE" in done.stderr


# -- one place reads the environment -----------------------------------------------------------

ENV_READERS = {"env_str", "env_int", "env_float", "env_bool", "env_list", "getenv"}
# Reads that are not settings: the variable a pool's configuration names for its upstream's
# secret (chosen per pool by the operator, read when the engine connects).
ALLOWED = {("workers/engine/upstream.py", "get")}


def _environment_reads(path: Path) -> list[tuple[int, str]]:
    """(line, what) for every read of the environment in one module."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ENV_READERS:
                found.append((node.lineno, name))
            elif (name == "get" and isinstance(func, ast.Attribute)
                  and isinstance(func.value, ast.Attribute) and func.value.attr == "environ"):
                found.append((node.lineno, "get"))
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
              and isinstance(node.value, ast.Attribute) and node.value.attr == "environ"):
            found.append((node.lineno, "subscript"))
    return found


def test_settings_are_read_from_the_environment_only_in_settings_py():
    """Every setting is read once, in gateway/settings.py (where a bad value stops start-up and
    the README's table lists it); modules read ``django.conf.settings``, which tests override."""
    offenders = []
    for package in ("gateway", "tenants", "metering", "workers"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ("gateway/settings.py", "gateway/env.py") or "/migrations/" in rel:
                continue
            offenders += [f"{rel}:{line} ({what})" for line, what in _environment_reads(path)
                          if (rel, what) not in ALLOWED]
    assert offenders == []
