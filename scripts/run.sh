#!/usr/bin/env bash
# Quick start: run the gateway on the embedded default (SQLite, embedded Redis, simulated engine).
# Arguments go to `manage.py serve` (--host, --port, ...); the first curl line printed uses them.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
export DEBUG=${DEBUG:-true}
.venv/bin/python manage.py migrate --noinput -v0
.venv/bin/python manage.py bootstrap_demo --base-url "$(scripts/base_url.sh "$@")"
exec .venv/bin/python manage.py serve "$@"
