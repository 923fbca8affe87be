#!/usr/bin/env bash
# Make .venv, install NCTV into it (once) and start the web app on the embedded default (CPU,
# offline): http://localhost:7860. PYTHON=/path/to/python3 picks the interpreter (3.10 or newer).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_env.sh
nctv_env
exec "$NCTV_PY" app.py "$@"
