#!/usr/bin/env bash
# Install NCTV and start the web app on the embedded default (CPU, offline): http://localhost:7860
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e .
exec python3 app.py "$@"
