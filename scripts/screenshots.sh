#!/usr/bin/env bash
# Regenerate docs/screenshots/*.png: the browser journeys (tests/test_browser.py) walk the portal,
# the admin and the docs in headless Chromium on a desktop and a phone and save each main page.
# Needs Chromium (CHROMIUM_PATH, default /usr/bin/chromium), the playwright package, PostgreSQL
# and Redis as for the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/screenshots
mkdir -p "$out"
rm -f "$out"/*.png
PORTAL_SCREENSHOTS="$out" exec "${PYTHON:-.venv/bin/python}" -m pytest tests/test_browser.py \
  -q -p no:warnings "$@"
