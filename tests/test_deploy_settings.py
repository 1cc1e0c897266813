"""Production settings: development secrets refused (naming the variable), https defaults, and
``manage.py check --deploy`` clean; the embedded quick start (DEBUG on) needs none of it."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.env import ImproperSetting, env_proxy_ssl_header

ROOT = Path(__file__).resolve().parent.parent
SECRETS = ("SECRET_KEY", "API_KEY_PEPPER", "API_KEY_PEPPERS", "CACHE_SALT_SECRET",
           "CONTENT_LOG_MASTER_KEYS", "GATEWAY_REQUIRE_SECRETS", "DEBUG", "SECURE_SSL_REDIRECT",
           "SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "TRUSTED_PROXY_CIDRS",
           "SECURE_PROXY_SSL_HEADER")
PRODUCTION = {
    "DEBUG": "false",
    "SECRET_KEY": "prod-secret-" + "k" * 20 + "0123456789abcdefghijklmnopqrstuvwxyz",
    "API_KEY_PEPPER": "prod-pepper-0123456789abcdef",
    "CACHE_SALT_SECRET": "prod-cache-salt-0123456789abcdef0123",
    "CONTENT_LOG_MASTER_KEYS": "p1:" + base64.b64encode(b"p" * 32).decode(),
}
SHOW = ("from django.conf import settings as s; import json; print(json.dumps({n: getattr(s, n) "
        "for n in ('DEBUG', 'SESSION_COOKIE_SECURE', 'CSRF_COOKIE_SECURE', 'SECURE_SSL_REDIRECT',"
        " 'SECURE_HSTS_SECONDS', 'SECURE_PROXY_SSL_HEADER', 'CACHE_SALT_SECRET')}))")


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS}
    full = {**clean, "DJANGO_SETTINGS_MODULE": "gateway.settings", **env}
    return subprocess.run([sys.executable, "-c", f"import django; django.setup(); {code}"],
                          cwd=ROOT, env=full, capture_output=True, text=True, timeout=60)


def refusal(**env: str) -> str:
    done = run("pass", **env)
    assert done.returncode != 0, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert "ImproperSetting" in last, done.stderr[-800:]
    return last


@pytest.mark.parametrize("missing,named", [
    ("SECRET_KEY", "SECRET_KEY"),
    ("API_KEY_PEPPER", "API_KEY_PEPPER"),
    ("CACHE_SALT_SECRET", "CACHE_SALT_SECRET"),
    ("CONTENT_LOG_MASTER_KEYS", "CONTENT_LOG_MASTER_KEYS"),
])
@pytest.mark.integration
def test_production_refuses_to_start_without_each_secret(missing, named):
    env = {k: v for k, v in PRODUCTION.items() if k != missing}
    assert named in refusal(**env)


@pytest.mark.integration
def test_debug_off_is_production_by_default():
    """No DEBUG at all is production: the development SECRET_KEY is refused."""
    env = {k: v for k, v in PRODUCTION.items() if k not in ("DEBUG", "SECRET_KEY")}
    assert "SECRET_KEY" in refusal(**env)


@pytest.mark.integration
def test_the_cache_salt_secret_is_its_own_secret():
    assert "CACHE_SALT_SECRET" in refusal(**{**PRODUCTION,
                                             "CACHE_SALT_SECRET": PRODUCTION["SECRET_KEY"]})


@pytest.mark.integration
def test_the_development_pepper_is_refused_among_several():
    env = {**PRODUCTION, "API_KEY_PEPPERS": "2:new-secret-0123456789abc,"
           "1:dev-pepper-change-me-0123456789"}
    assert "API_KEY_PEPPERS" in refusal(**env)


@pytest.mark.integration
def test_production_starts_with_real_secrets_and_https_defaults():
    done = run(SHOW, **PRODUCTION, TRUSTED_PROXY_CIDRS="10.0.0.0/8")
    assert done.returncode == 0, done.stderr[-800:]
    shown = json.loads(done.stdout)
    assert shown["DEBUG"] is False and shown["SESSION_COOKIE_SECURE"] is True
    assert shown["CSRF_COOKIE_SECURE"] is True and shown["SECURE_SSL_REDIRECT"] is True
    assert shown["SECURE_HSTS_SECONDS"] >= 31_536_000
    assert shown["SECURE_PROXY_SSL_HEADER"] == ["HTTP_X_FORWARDED_PROTO", "https"]


@pytest.mark.integration
def test_the_embedded_quick_start_needs_no_secrets():
    """scripts/run.sh runs with DEBUG on and none of the secrets set."""
    done = run(SHOW, DEBUG="true")
    assert done.returncode == 0, done.stderr[-800:]
    shown = json.loads(done.stdout)
    assert shown["SESSION_COOKIE_SECURE"] is False and shown["SECURE_SSL_REDIRECT"] is False
    assert shown["CACHE_SALT_SECRET"]  # development default


@pytest.mark.integration
def test_check_deploy_is_clean_with_production_settings():
    done = subprocess.run(["scripts/check_deploy.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.integration
def test_check_deploy_flags_an_insecure_cookie():
    """The same check fails when a https setting is off: it is a real gate."""
    insecure = run("from django.core.management import call_command; "
                   "call_command('check', deploy=True, fail_level='WARNING')",
                   **PRODUCTION, SESSION_COOKIE_SECURE="false", ALLOWED_HOSTS="gw.example.com")
    assert insecure.returncode != 0 and "security.W012" in insecure.stderr


@pytest.mark.parametrize("value,expected", [
    ("X-Forwarded-Proto: https", ("HTTP_X_FORWARDED_PROTO", "https")),
    ("off", None), ("", None),
])
def test_proxy_ssl_header_setting(monkeypatch, value, expected):
    monkeypatch.setenv("SECURE_PROXY_SSL_HEADER", value)
    assert env_proxy_ssl_header("SECURE_PROXY_SSL_HEADER", "") == expected


def test_a_malformed_proxy_ssl_header_is_refused(monkeypatch):
    monkeypatch.setenv("SECURE_PROXY_SSL_HEADER", "X-Forwarded-Proto")
    with pytest.raises(ImproperSetting, match="SECURE_PROXY_SSL_HEADER"):
        env_proxy_ssl_header("SECURE_PROXY_SSL_HEADER", "")
