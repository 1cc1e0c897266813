#!/bin/sh
# One image, several roles. Signals reach the process directly (exec), so SIGTERM starts the
# graceful paths: a gateway ends its streams retryably and stops within GATEWAY_SHUTDOWN_SECONDS;
# a pool worker drains for WORKER_DRAIN_SECONDS (docs/deployment.md).
set -eu
role="${1:-gateway}"
[ "$#" -gt 0 ] && shift
py="$(command -v python3 || command -v python)"
level="$(printf '%s' "${LOG_LEVEL:-info}" | tr '[:upper:]' '[:lower:]')"
case "$role" in
  gateway)
    grace="$(printf '%.0f' "${GATEWAY_SHUTDOWN_SECONDS:-5}")"
    # infra/uvicorn_command.py writes the uvicorn command line (--no-proxy-headers, the
    # bounded HTTP protocol) for every way the gateway starts, and execs it.
    exec "$py" -m infra.uvicorn_command --host 0.0.0.0 --port "${PORT:-8000}" \
      --timeout-graceful-shutdown "$grace" --workers "${GATEWAY_PROCESSES:-1}" "$@" ;;
  worker)
    pool="${1:-${ENGINE_POOL:?worker needs a pool name: worker POOL or ENGINE_POOL}}"
    [ "$#" -gt 0 ] && shift
    exec "$py" -m celery -A gateway worker --engine-pool "$pool" -P solo -c 1 \
      -n "$pool@${HOSTNAME:-worker}" -l "$level" --without-mingle --without-gossip "$@" ;;
  housekeeping)
    exec "$py" -m celery -A gateway worker -P solo -c 1 -n "housekeeping@${HOSTNAME:-hk}" \
      -l "$level" --without-mingle --without-gossip "$@" ;;
  beat)
    exec "$py" -m celery -A gateway beat -s "${GATEWAY_VAR_DIR:-/app/var}/celerybeat-schedule" \
      -l warning "$@" ;;
  migrate)
    exec "$py" manage.py migrate --noinput "$@" ;;
  *)
    exec "$role" "$@" ;;
esac
