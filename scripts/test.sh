#!/usr/bin/env bash
# Run lint and the whole test suite against PostgreSQL and Redis (the README's test command);
# starts both on 127.0.0.1 when they are not answering.
#
#   scripts/test.sh                    lint, then the unit lane, then the rest, in parallel
#   scripts/test.sh tests/test_x.py    lint, then only what you name (pytest's arguments)
#
# The unit lane (--unit-lane: neither `integration` nor `slow`) starts no process, and fails a
# test in it that does. TEST_WORKERS sets the pytest-xdist workers of both lanes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
scripts/bootstrap.sh
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/1}
echo "==> ruff"
.venv/bin/ruff check .
echo "==> mypy --strict (every package: gateway, workers, metering, serving, infra, tenants, catalog)"
DEBUG=true .venv/bin/mypy  # the Django plugin loads the settings: development ones suffice
echo "==> manage.py check --deploy (production settings, warnings fail)"
scripts/check_deploy.sh
echo "==> pytest (database: ${DATABASE_URL%%\?*}, redis: $REDIS_URL)"
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi

# Workers. The unit lane is CPU-bound and short: twice the cores (at most 8). The live lane
# starts real processes and runs in three workers: it waits on processes as much as it computes
# (about a quarter of the 2-core machine idled at -n 2 once each vLLM engine start cost two
# processes, not three), so a third worker fills what two left idle: 527 s at -n 2, 370 s at
# -n 3 in session 12, no failure (ADR 0031). Its timing-asserting tests wait on conditions.
# Worker i uses Redis db (REDIS_URL's db + i) (tests/testenv.py), so workers must fit in Redis'
# 16 dbs. TEST_WORKERS sets the unit lane's, LIVE_TEST_WORKERS the live lane's.
base_db=${REDIS_URL##*/}
[[ $base_db =~ ^[0-9]+$ ]] || base_db=0
cap() { local n=$1; (( n > 8 )) && n=8; (( n > 16 - base_db )) && n=$(( 16 - base_db )); (( n < 1 )) && n=1; echo "$n"; }
unit_workers=$(cap "${TEST_WORKERS:-$(( $(nproc) * 2 ))}")
live_workers=$(cap "${LIVE_TEST_WORKERS:-3}")

# lane NAME WORKERS ARGS...: runs pytest, records its wall time in NAME_s and its status in
# NAME_rc.
# Exit 5 (nothing collected) is not a failure here: a lane may be empty on a narrowed tree.
lane() {
  local name=$1 workers=$2 rc=0 start
  shift 2
  start=$SECONDS
  .venv/bin/python -m pytest -n "$workers" "$@" || rc=$?
  (( rc == 5 )) && rc=0
  printf -v "${name}_s" '%d' $(( SECONDS - start ))
  printf -v "${name}_rc" '%d' "$rc"
}

echo "==> unit lane ($unit_workers workers)"
lane unit "$unit_workers" --unit-lane
echo "==> integration and slow tests ($live_workers workers)"
lane live "$live_workers" -m "integration or slow" --durations=15

verdict() { (( $1 <= $2 )) && echo "within" || echo "OVER"; }
total_s=$(( unit_s + live_s ))
echo "==> targets"
echo "unit lane:  ${unit_s} s (target 120 s: $(verdict "$unit_s" 120))"
echo "full suite: ${total_s} s of test time (target 600 s: $(verdict "$total_s" 600))"
(( unit_rc == 0 && live_rc == 0 )) || exit 1
