"""The test suite's deployment settings, set before Django reads its settings (``-p tests.testenv``
in pyproject's addopts, so this runs before pytest-django configures Django).

The suite runs with DEBUG off, as production does, so it needs its own secrets: production
refuses the development ones (``gateway.env.require_production_secrets``). Live processes the
tests start (uvicorn, Celery) inherit this environment. They speak plain http on 127.0.0.1,
hence no https redirect and no Secure-only cookies here; ``tests/test_deploy_settings.py``
checks the real production defaults with ``manage.py check --deploy``.
Values already in the environment win (CI may set its own).
"""

from __future__ import annotations

import base64
import os
import sys
from typing import Any

import pytest

TEST_ENV = {
    "SECRET_KEY": "test-suite-secret-key-not-for-production-0123456789abcdef",
    "API_KEY_PEPPER": "test-suite-pepper-0123456789abcdef",
    "CACHE_SALT_SECRET": "test-suite-cache-salt-secret-0123456789abcdef",
    "CONTENT_LOG_MASTER_KEYS": "test1:" + base64.b64encode(b"t" * 32).decode(),
    "SECURE_SSL_REDIRECT": "false",
    "SESSION_COOKIE_SECURE": "false",
    "CSRF_COOKIE_SECURE": "false",
}

for _name, _value in TEST_ENV.items():
    os.environ.setdefault(_name, _value)


# ---- bytecode caches -----------------------------------------------------------------------
# A run starts many Python processes: its xdist workers (four on 2 cores), and in the live lane a
# gateway and Celery workers per module. Under PYTHONDONTWRITEBYTECODE (container images set it:
# deploy/Dockerfile, and so may CI's) none of them finds a cached .pyc of the project, so each
# compiles every module it imports, and each pytest worker rewrites the assertions of every test
# module again: measured on the 2-core machine, 9.7 s of CPU per worker to collect the unit
# lane, 4.1 s with the caches. The run writes them, as any checkout's run does by default
# (__pycache__ is ignored by git); the children inherit the environment without the variable.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


# ---- parallel runs (pytest-xdist) ----------------------------------------------------------
# Each xdist worker ("gw0", "gw1", ...) runs against its own Redis db: the db in REDIS_URL plus
# the worker's index, so ``redis_client``'s FLUSHDB and the tests that list every key see only
# their worker's keys. A db, not a key prefix: Celery's broker keys and the tests' own KEYS
# scans are not prefixed, a db isolates them all. Live processes inherit it
# (tests/procs.py child_env passes REDIS_URL on). PostgreSQL needs nothing here: pytest-django
# suffixes the test database per worker (test_<name>_gw0, ...).
# xdist sets PYTEST_XDIST_WORKER before the worker reads its plugins, so this runs first.


def worker_index() -> int:
    """This xdist worker's index (0 when not under xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") else 0


def redis_url_for_worker(url: str, index: int) -> str:
    """``url`` with its db number moved on by ``index`` (db 0 when it names none)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    path = parts.path.strip("/")
    db = int(path) if path.isdigit() else 0
    return urlunsplit(parts._replace(path=f"/{db + index}"))


if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("REDIS_URL"):
    os.environ["REDIS_URL"] = redis_url_for_worker(os.environ["REDIS_URL"], worker_index())


# ---- the unit lane -------------------------------------------------------------------------
# ``--unit-lane`` runs the tests marked neither ``integration`` nor ``slow`` and fails any of
# them that starts a process (a subprocess, asyncio's subprocesses, a fork): the markers are
# what keeps that lane fast, and this keeps them honest.
UNIT_LANE = "not integration and not slow"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--unit-lane", action="store_true",
                     help=f"run -m '{UNIT_LANE}' and fail a test there that starts a process")


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("--unit-lane"):
        return
    if config.option.markexpr:
        config.option.markexpr = f"({config.option.markexpr}) and {UNIT_LANE}"
    else:
        config.option.markexpr = UNIT_LANE
    # pyproject's --dist loadfile keeps a module on one worker so that its live system starts
    # once; the unit lane starts none, and by file one worker drew the 1,047 tests of
    # test_api_permissions.py and finished ~100 s after the others. Workers steal tests instead.
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.dist = "worksteal"
    config.pluginmanager.register(_ProcessGuard(), "unit-lane-guard")


class _ProcessGuard:
    """Refuses every process start while a unit-lane test runs, and fails the test even if
    it caught the refusal."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def _refuse(self, what: str) -> None:
        self.started.append(what)
        raise RuntimeError(f"unit lane: this test started a process ({what}); "
                           "mark it integration (or slow)")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Any:
        import subprocess

        guard = self
        real_execute = subprocess.Popen._execute_child  # type: ignore[attr-defined]
        real_fork = os.fork

        def execute_child(popen: Any, args: Any, *rest: Any, **kw: Any) -> None:
            guard._refuse(f"subprocess {args!r}"[:300])

        def fork() -> int:
            guard._refuse("os.fork()")
            return -1

        self.started = []
        subprocess.Popen._execute_child = execute_child  # type: ignore[attr-defined]
        os.fork = fork
        try:
            yield
        finally:
            subprocess.Popen._execute_child = real_execute  # type: ignore[attr-defined]
            os.fork = real_fork

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        outcome = yield
        report = outcome.get_result()
        if self.started and not report.failed:
            report.outcome = "failed"
            report.longrepr = ("unit lane: the test started a process and is marked neither "
                               "integration nor slow:\n  " + "\n  ".join(self.started))
            self.started = []
