#!/usr/bin/env bash
# Check the lower bounds of the dependencies: install every one of them exactly (">=X" becomes
# "==X", for the project's dependencies and its test extras) together with NCTV in a throwaway
# virtual environment, then run a representative subset of the tests there. See docs/install.md.
#
#   bash scripts/check_min_versions.sh                 # the default subset of tests
#   bash scripts/check_min_versions.sh tests/test_zoo.py -k local   # pytest arguments instead
#
# PYTHON picks the interpreter (default python3; the oldest PyTorch allowed has no wheels for
# Python 3.13, so use 3.10-3.12). NCTV_MIN_VENV is where the environment goes (default
# $TMPDIR/nctv-min-venv, made afresh on every run; NCTV_MIN_REUSE=1 runs the tests in the one a
# previous run made, without installing again). Downloads the old PyTorch (several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${NCTV_MIN_VENV:-${TMPDIR:-/tmp}/nctv-min-venv}"

# The pins, from requirements-test.txt (which includes requirements.txt); the same bounds as in
# pyproject.toml, which is checked where tomllib exists (Python 3.11+).
mapfile -t PINS < <("$PY" - <<'PYEOF'
import re, sys
from pathlib import Path

def read(name):
    for line in Path(name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            yield from read(line[3:].strip())
        elif line:
            yield line

def norm(req):
    return re.sub(r"\s+", "", req).lower().replace("_", "-")

reqs = list(read("requirements-test.txt"))
try:
    import tomllib
except ImportError:
    tomllib = None
if tomllib:
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["test"]
    # requirements.txt narrows PyTorch to what a ZeroGPU Space runs; the library's lower bounds are
    # pyproject.toml's, and every other line must agree with it.
    space = {"torch", "torchvision"}
    name = lambda r: re.match(r"[a-z0-9_.\-]+", norm(r)).group(0)
    if (sorted(norm(r) for r in declared if name(r) not in space) != sorted(norm(r) for r in reqs if name(r) not in space)
            or sorted(map(name, declared)) != sorted(map(name, reqs))):
        sys.exit("pyproject.toml and requirements*.txt disagree:\n  %s\n  %s" % (sorted(declared), sorted(reqs)))
    reqs = declared
for req in reqs:
    m = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*(.*)", req)
    low = re.search(r">=\s*([^,\s]+)", m.group(2))
    if not low:
        sys.exit(f"{req}: no lower bound (>=) to check")
    print(f"{m.group(1)}=={low.group(1)}")
PYEOF
)
[ "${#PINS[@]}" -gt 0 ] || exit 1
if [ "$#" -eq 0 ]; then
  # Metrics, calibrators, Neural Clamping, model loading (local-dir, Hub cache layout, save_for_hf),
  # data, figures, tables, the command line, the app's handlers, its API (gradio_client) and the
  # page in headless Chromium (playwright; skipped without /usr/bin/chromium), the install script.
  # Not here: the longest end-to-end runs (-m "not slow").
  set -- tests/test_metrics.py tests/test_temperature.py tests/test_linear.py tests/test_clamping.py \
    tests/test_zoo.py tests/test_data.py tests/test_plots.py tests/test_report.py tests/test_cli.py \
    tests/test_ui_handlers.py tests/test_app_client.py tests/test_browser.py tests/test_install.py \
    -m "not slow" -q
fi

echo "check_min_versions: Python $("$PY" -c 'import sys; print(sys.version.split()[0])') ($PY), environment $VENV"
echo "check_min_versions: pins: ${PINS[*]}"
if [ "${NCTV_MIN_REUSE:-0}" = 1 ] && [ -x "$VENV/bin/python" ]; then
  echo "check_min_versions: reusing $VENV (NCTV_MIN_REUSE=1)"
else
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e . "${PINS[@]}"
fi
"$VENV/bin/python" -m pip check
echo "check_min_versions: installed:"
names="$(printf '%s\n' "${PINS[@]}" | sed 's/==.*//' | paste -sd' ')"
"$VENV/bin/python" - $names <<'PYEOF'
import sys
from importlib.metadata import version
print("  " + ", ".join(f"{n} {version(n)}" for n in sys.argv[1:]))
PYEOF
exec "$VENV/bin/python" -m pytest -p no:cacheprovider "$@"
