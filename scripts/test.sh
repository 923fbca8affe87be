#!/usr/bin/env bash
# Make .venv, install NCTV with its test extras into it (once) and Debian's Chromium for the browser
# tests, then run the tests: arguments go to pytest. PYTHON=/path/to/python3 picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_env.sh
nctv_env test
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  _nctv_say "installing Debian's chromium for the browser tests"
  _nctv_apt_install chromium || _nctv_die "could not install Debian's chromium (the browser tests need it)"
fi
exec "$NCTV_PY" -m pytest "$@"
