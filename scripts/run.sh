#!/usr/bin/env bash
# Quick start: run the gateway on the embedded default (SQLite, embedded Redis, simulated engine).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export DEBUG=${DEBUG:-true}
.venv/bin/python manage.py migrate --noinput -v0
.venv/bin/python manage.py bootstrap_demo
exec .venv/bin/python manage.py serve "$@"
