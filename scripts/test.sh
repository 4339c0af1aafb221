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
exec python -m pytest "$@"
