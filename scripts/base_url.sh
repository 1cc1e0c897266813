#!/usr/bin/env bash
# Print the base URL that `manage.py serve ARGS...` will answer on (its --host and --port), so
# the quick start's first curl line points where the gateway really listens.
set -euo pipefail
host=127.0.0.1 port=8000
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --port=*) port="${args[i]#--port=}" ;;
    --port) port="${args[i + 1]:-$port}" ;;
    --host=*) host="${args[i]#--host=}" ;;
    --host) host="${args[i + 1]:-$host}" ;;
  esac
done
[[ $host == 0.0.0.0 ]] && host=127.0.0.1  # listening everywhere: reachable here on loopback
echo "http://$host:$port"
