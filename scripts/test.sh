#!/usr/bin/env bash
# Run lint and the whole test suite against PostgreSQL and Redis (the README's test command);
# starts both on 127.0.0.1 when they are not answering.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
scripts/bootstrap.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/1}
echo "==> ruff"
.venv/bin/ruff check .
echo "==> mypy --strict (every package: gateway, workers, metering, serving, infra, tenants)"
DEBUG=true .venv/bin/mypy  # the Django plugin loads the settings: development ones suffice
echo "==> manage.py check --deploy (production settings, warnings fail)"
scripts/check_deploy.sh
echo "==> pytest (database: ${DATABASE_URL%%\?*}, redis: $REDIS_URL)"
exec .venv/bin/python -m pytest "$@"
