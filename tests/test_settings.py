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
])
def test_bad_value_stops_startup_naming_the_setting(name, value):
    done = start(**{name: value})
    assert done.returncode != 0
    last_line = done.stderr.strip().splitlines()[-1]
    assert "ImproperSetting" in last_line and name in last_line, done.stderr[-500:]


def test_secret_read_from_a_missing_file_names_the_setting(tmp_path):
    done = start(SECRET_KEY_FILE=str(tmp_path / "absent"))
    assert done.returncode != 0 and "SECRET_KEY_FILE" in done.stderr
