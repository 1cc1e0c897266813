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
