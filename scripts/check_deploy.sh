#!/usr/bin/env bash
# `manage.py check --deploy` with production settings (DEBUG off, fresh random secrets, https
# defaults): any warning fails. scripts/test.sh runs it; so does tests/test_deploy_settings.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
secret() { "$PY" -c 'import secrets; print(secrets.token_urlsafe(48))'; }
masterkey() { "$PY" -c 'import base64, os; print("ci:" + base64.b64encode(os.urandom(32)).decode())'; }
exec env -u SECURE_SSL_REDIRECT -u SESSION_COOKIE_SECURE -u CSRF_COOKIE_SECURE \
  -u SECURE_HSTS_SECONDS -u SECURE_HSTS_INCLUDE_SUBDOMAINS -u SECURE_HSTS_PRELOAD \
  -u GATEWAY_REQUIRE_SECRETS -u API_KEY_PEPPERS \
  DEBUG=false \
  SECRET_KEY="$(secret)" API_KEY_PEPPER="$(secret)" CACHE_SALT_SECRET="$(secret)" \
  CONTENT_LOG_MASTER_KEYS="$(masterkey)" \
  ALLOWED_HOSTS="${DEPLOY_CHECK_HOSTS:-gateway.example.com}" \
  TRUSTED_PROXY_CIDRS="${TRUSTED_PROXY_CIDRS:-10.0.0.0/8}" \
  "$PY" manage.py check --deploy --fail-level WARNING
