# Shared by scripts/start.sh and scripts/test.sh: make the virtual environment .venv in the
# repository root and install NCTV into it, so that nothing has to be installed by hand and the
# system Python is never touched (Debian 12 / Ubuntu 24.04 refuse `pip install` there: PEP 668).
#
#   . scripts/_env.sh && nctv_env [test]     # sourced: sets NCTV_PY to the environment's python
#   bash scripts/_env.sh [test]              # the same, run alone; prints the python's path
#   bash scripts/_env.sh --check [test]      # changes nothing; exit 0 when .venv is ready, else 1
#
# The argument names the extras to install ("test" for `pip install -e ".[test]"`).
# Settings (environment variables):
#   PYTHON            interpreter that makes the environment (default python3; needs 3.10 or newer)
#   NCTV_VENV         where the environment lives (default <repository>/.venv)
#   NCTV_REINSTALL=1  run pip even when the environment is up to date
#   NCTV_UNPINNED=1   install the newest versions pyproject.toml admits instead of constraints.txt
#   NCTV_IMPORT_CHECK modules imported after an install to prove it works
#                     (default: nctv.zoo, torchvision, gradio)
#
# pip installs the versions pinned in constraints.txt (one tested set; pyproject.toml keeps ranges).
# An environment is reused while its python runs and comes from the same interpreter (same prefix
# and Python version); otherwise it is made again. pip runs only when pyproject.toml or the
# requirements files changed since the last install: a stamp file in the environment holds their hash.

NCTV_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NCTV_VENV="${NCTV_VENV:-$NCTV_ROOT/.venv}"
NCTV_MIN_PYTHON="3.10"
NCTV_MIN_PIP="21.3"  # the first pip that installs a pyproject.toml-only project in editable mode (PEP 660)

_nctv_say() { printf 'nctv: %s\n' "$*" >&2; }
_nctv_die() { printf 'nctv: error: %s\n' "$*" >&2; exit 1; }

# _nctv_probe PY: "<version> <prefix>" of an interpreter (major.minor.micro, sys.base_prefix), or fails.
_nctv_probe() {
  "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3], sys.base_prefix)' 2>/dev/null
}

_nctv_version_ok() {  # _nctv_version_ok HAVE NEED: HAVE >= NEED, both dotted numbers
  [ "$(printf '%s\n%s\n' "$2" "$1" | sort -t. -k1,1n -k2,2n -k3,3n | head -n1)" = "$2" ]
}

# Picks the interpreter: sets NCTV_BASE_PY, NCTV_BASE_VERSION (3.11.2), NCTV_BASE_PREFIX.
nctv_pick_python() {
  local py="${PYTHON:-python3}" probe
  if ! command -v "$py" >/dev/null 2>&1; then
    _nctv_die "no Python interpreter '$py'. Install Python $NCTV_MIN_PYTHON or newer (Debian/Ubuntu: apt-get install python3 python3-venv), or set PYTHON=/path/to/python3."
  fi
  probe="$(_nctv_probe "$py")" || _nctv_die "'$py' does not run as a Python interpreter; set PYTHON=/path/to/python3 ($NCTV_MIN_PYTHON or newer)."
  NCTV_BASE_PY="$(command -v "$py")"
  NCTV_BASE_VERSION="${probe%% *}"
  NCTV_BASE_PREFIX="${probe#* }"
  if ! _nctv_version_ok "$NCTV_BASE_VERSION" "$NCTV_MIN_PYTHON"; then
    _nctv_die "NCTV needs Python $NCTV_MIN_PYTHON or newer; '$py' is Python $NCTV_BASE_VERSION. Install a newer Python and run again with PYTHON=/path/to/python3.X."
  fi
}

# Why .venv cannot be reused (empty output: it can).
_nctv_venv_problem() {
  local vpy="$NCTV_VENV/bin/python" probe version prefix
  [ -e "$NCTV_VENV" ] || { echo "missing"; return; }
  [ -f "$NCTV_VENV/pyvenv.cfg" ] || { echo "not a virtual environment (no pyvenv.cfg)"; return; }
  probe="$(_nctv_probe "$vpy")" || { echo "its python does not run"; return; }
  version="${probe%% *}" prefix="${probe#* }"
  if [ "$prefix" != "$NCTV_BASE_PREFIX" ] || [ "${version%.*}" != "${NCTV_BASE_VERSION%.*}" ]; then
    echo "it was made by another interpreter (Python $version in $prefix, not $NCTV_BASE_VERSION in $NCTV_BASE_PREFIX)"
  fi
}

_nctv_apt_install() {  # _nctv_apt_install PACKAGE...: apt-get install, with sudo when not root
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || return 1
    sudo="sudo"
  fi
  $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# Python's venv module needs ensurepip, which Debian and Ubuntu ship apart (python3.X-venv).
_nctv_install_venv_module() {
  local mm="${NCTV_BASE_VERSION%.*}" pkg
  pkg="python$mm-venv"
  if command -v apt-get >/dev/null 2>&1 && [ "$NCTV_BASE_PREFIX" = "/usr" ]; then
    _nctv_say "Python's venv module is missing (no ensurepip); installing Debian's $pkg with apt-get"
    _nctv_apt_install "$pkg" || _nctv_apt_install python3-venv \
      || _nctv_die "could not install $pkg with apt-get; install it (sudo apt-get install $pkg) and run again."
  else
    _nctv_die "'$NCTV_BASE_PY' cannot make a virtual environment (its venv/ensurepip module is missing). Install it (Debian/Ubuntu: sudo apt-get install $pkg; elsewhere the package that provides Python's venv module) or set PYTHON to another Python $NCTV_MIN_PYTHON+."
  fi
}

_nctv_try_venv() {  # sets out; 0 when the new environment's python runs
  if out="$("$NCTV_BASE_PY" -m venv "$NCTV_VENV" 2>&1)" && _nctv_probe "$NCTV_VENV/bin/python" >/dev/null; then
    return 0
  fi
  rm -rf "$NCTV_VENV"
  return 1
}

_nctv_make_venv() {
  local out
  _nctv_try_venv && return 0
  if ! "$NCTV_BASE_PY" -c 'import ensurepip' >/dev/null 2>&1 || [[ "$out" == *ensurepip* ]]; then
    _nctv_install_venv_module
    _nctv_try_venv && return 0
  fi
  _nctv_die "could not make a virtual environment with '$NCTV_BASE_PY -m venv $NCTV_VENV':
${out:-its python does not run}"
}

# Makes .venv when it is missing or unusable; sets NCTV_PY.
nctv_ensure_venv() {
  local problem
  problem="$(_nctv_venv_problem)"
  if [ -n "$problem" ]; then
    if [ "$problem" != missing ]; then
      if [ ! -f "$NCTV_VENV/pyvenv.cfg" ] && [ -n "$(ls -A "$NCTV_VENV" 2>/dev/null)" ]; then
        _nctv_die "$NCTV_VENV exists but is $problem; move it away (or set NCTV_VENV) and run again."
      fi
      _nctv_say "making $NCTV_VENV again: $problem"
      rm -rf "$NCTV_VENV"
    fi
    _nctv_say "making the virtual environment $NCTV_VENV with Python $NCTV_BASE_VERSION ($NCTV_BASE_PY)"
    _nctv_make_venv
  fi
  NCTV_PY="$NCTV_VENV/bin/python"
}

# Hash of what decides the installed packages: the project files, the extras, the Python version.
_nctv_stamp_hash() {
  "$NCTV_PY" - "$1" "$NCTV_ROOT" <<'EOF'
import hashlib, pathlib, sys
h = hashlib.sha256(("extras=%s python=%s\n" % (sys.argv[1], sys.version)).encode())
root = pathlib.Path(sys.argv[2])
for name in ("pyproject.toml", "requirements.txt", "requirements-test.txt", "constraints.txt"):
    p = root / name
    h.update(name.encode() + b"\0" + (p.read_bytes() if p.is_file() else b"") + b"\0")
print(h.hexdigest())
EOF
}

_nctv_stamp_file() { echo "$NCTV_VENV/.nctv-installed-${1:-base}"; }

# 0 when the stamp for these extras matches the project files.
nctv_up_to_date() {
  local stamp
  stamp="$(_nctv_stamp_file "$1")"
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(_nctv_stamp_hash "$1")" ]
}

_nctv_has_module() { "$NCTV_PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)' "$1" 2>/dev/null; }

# pip install -e . (or ".[extras]") into .venv unless the stamp says it is done.
nctv_install() {
  local extras="${1:-}" spec="." pipv quiet="-q" hash
  [ -n "$extras" ] && spec=".[$extras]"
  if [ "${NCTV_REINSTALL:-0}" != 1 ] && nctv_up_to_date "$extras"; then
    _nctv_say "using $NCTV_VENV (Python $NCTV_BASE_VERSION); packages up to date"
    return 0
  fi
  pipv="$("$NCTV_PY" -c 'import pip; print(pip.__version__)' 2>/dev/null || echo 0)"
  if ! _nctv_version_ok "$pipv" "$NCTV_MIN_PIP"; then
    _nctv_say "upgrading pip $pipv in $NCTV_VENV (editable installs need $NCTV_MIN_PIP or newer)"
    if [ "$pipv" = 0 ]; then "$NCTV_PY" -m ensurepip -q >/dev/null 2>&1 || true; fi
    "$NCTV_PY" -m pip install -q --upgrade pip || _nctv_die "could not upgrade pip in $NCTV_VENV"
  fi
  if ! _nctv_has_module torch && grep -q '"torch' "$NCTV_ROOT/pyproject.toml"; then
    _nctv_say "first install: PyTorch is large (several GB with its CUDA libraries); this download happens once, later runs reuse $NCTV_VENV"
    quiet=""
  fi
  local pins=()
  if [ "${NCTV_UNPINNED:-0}" != 1 ] && [ -f "$NCTV_ROOT/constraints.txt" ]; then
    pins=(-c "$NCTV_ROOT/constraints.txt")  # the tested versions (constraints.txt); NCTV_UNPINNED=1: newest
  fi
  _nctv_say "installing NCTV ($spec) into $NCTV_VENV"
  (cd "$NCTV_ROOT" && "$NCTV_PY" -m pip install $quiet --disable-pip-version-check ${pins[@]+"${pins[@]}"} -e "$spec") \
    || _nctv_die "pip could not install NCTV into $NCTV_VENV (see above)."
  local check="${NCTV_IMPORT_CHECK-nctv.zoo, torchvision, gradio}" err
  if [ -n "$check" ] && ! err="$(cd "$NCTV_ROOT" && "$NCTV_PY" -c "import $check" 2>&1)"; then
    _nctv_die "the installed packages do not import ($check):
$(printf '%s\n' "$err" | tail -n 5)"
  fi
  hash="$(_nctv_stamp_hash "$extras")"
  echo "$hash" >"$(_nctv_stamp_file "$extras")"
  # The extras add to the base install, so it is up to date as well.
  [ -n "$extras" ] && _nctv_stamp_hash "" >"$(_nctv_stamp_file "")"
  return 0
}

# Everything: interpreter, environment, packages. Sets NCTV_PY.
nctv_env() {
  nctv_pick_python
  nctv_ensure_venv
  nctv_install "${1:-}"
}

# 0 when nctv_env would find nothing to do (changes nothing).
nctv_check() {
  local problem
  nctv_pick_python
  problem="$(_nctv_venv_problem)"
  if [ -n "$problem" ]; then _nctv_say "$NCTV_VENV: $problem"; return 1; fi
  NCTV_PY="$NCTV_VENV/bin/python"
  if ! nctv_up_to_date "${1:-}"; then _nctv_say "$NCTV_VENV: packages not installed or out of date"; return 1; fi
  _nctv_say "$NCTV_VENV is ready (Python $NCTV_BASE_VERSION)"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # run, not sourced
  set -euo pipefail
  if [ "${1:-}" = "--check" ]; then
    shift
    nctv_check "${1:-}"
  else
    nctv_env "${1:-}"
    echo "$NCTV_PY"
  fi
fi
