#!/usr/bin/env bash
# Install the project with its test and docs extras (in .venv unless a virtualenv is active) and run the full
# test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
echo "scripts/test.sh: installing the project and its test and docs extras into $VIRTUAL_ENV (a few minutes the first time)" >&2
python -m pip install --quiet --disable-pip-version-check -e ".[test,docs]"
# The package's bytecode, as an installed wheel has it: where PYTHONDONTWRITEBYTECODE is set (it is on our
# development machines), every interpreter the tests start (the command line, its worker programs) compiled the
# package's modules it imports again, 60-110 ms each (3-4% of the CPU of the command-line tests).
python -m compileall -q tracefuse_dask
# Composer's own trace merger, the reference of tests/test_composer.py. Its dependencies pin an old torch (gigabytes);
# the test loads only composer/profiler/json_trace_merger.py, which imports nothing but the standard library.
python -m pip install --quiet --disable-pip-version-check --no-deps "composer==0.32.1" 2>/dev/null
# Debian packages some tests use, installed when we are root and they are missing; without them those tests skip:
# chromium and chromedriver (the report's browser tests), docker-compose (validates deploy/docker-compose.yml).
missing=()
[ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] || missing+=(chromium chromium-driver)
if command -v docker >/dev/null && ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
  missing+=(docker-compose)
fi
if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >/dev/null 2>&1 \
    || echo "scripts/test.sh: could not install ${missing[*]}; the tests that need them will skip" >&2
fi
# Two workers (pytest-xdist), each taking whole modules, so that a module fixture is made once. The tests marked
# serial, which time what they measure, have the machine to themselves (tests/conftest.py). -n 0: one process.
echo "scripts/test.sh: running the tests: python -m pytest -n 2 --dist loadscope $*" >&2
exec python -m pytest -n 2 --dist loadscope "$@"
