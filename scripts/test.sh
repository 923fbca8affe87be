#!/usr/bin/env bash
# Install what the tests need (Python packages, and Debian's Chromium for the browser tests), then run them.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
python3 -m pip install -q -e ".[test]"
exec python3 -m pytest "$@"
