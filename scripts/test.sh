#!/usr/bin/env bash
# Install the project with its test extras (in .venv unless a virtualenv is active) and run the full test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
python -m pip install --quiet --disable-pip-version-check -e ".[test]"
# The report's browser tests need Debian's chromium and chromedriver; without them they skip.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && { [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; }; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } >/dev/null 2>&1 \
    || echo "scripts/test.sh: could not install chromium; the browser tests will skip" >&2
fi
exec python -m pytest "$@"
