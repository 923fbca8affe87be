"""scripts/_env.sh, the environment set-up behind scripts/start.sh and scripts/test.sh.

The script runs for real (interpreter check, ``python -m venv``, ``pip install -e``, the stamp that
skips pip) on a toy project in a temporary folder: a copy of scripts/_env.sh beside a pyproject.toml
with no dependencies and an in-tree build backend, so pip needs no index (PIP_NO_INDEX=1) and no
PyTorch download. The interpreter is Debian's system Python, /usr/bin/python3, which refuses
``pip install`` outside a virtual environment (PEP 668) on Debian 12 and Ubuntu 24.04.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV_SH = ROOT / "scripts" / "_env.sh"
SYSTEM_PY = "/usr/bin/python3"


def _probe(py):
    try:
        out = subprocess.run([py, "-c", "import sys, ensurepip; print('%d.%d' % sys.version_info[:2], sys.base_prefix)"],
                             capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return out.stdout.split() if out.returncode == 0 else None


_SYSTEM = _probe(SYSTEM_PY)
needs_system_python = pytest.mark.skipif(
    _SYSTEM is None or tuple(int(v) for v in _SYSTEM[0].split(".")) < (3, 10),
    reason=f"needs {SYSTEM_PY} (Python 3.10+ with its venv module)")

BACKEND = '''"""PEP 517 backend without build requirements: pip builds the toy with nothing from an index."""
import base64, hashlib, os, re, zipfile


def _wheel(directory, files):
    text = open("pyproject.toml").read()
    name, version = (re.search(key + r' = "(.*)"', text).group(1) for key in ("name", "version"))
    dist = f"{name}-{version}.dist-info"
    files = {**files, f"{dist}/METADATA": f"Metadata-Version: 2.1\\nName: {name}\\nVersion: {version}\\nProvides-Extra: test\\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\\nGenerator: toy\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(data.encode())}" for path, data in files.items()]
    files[f"{dist}/RECORD"] = "\\n".join(record + [f"{dist}/RECORD,,"]) + "\\n"
    filename = f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(directory, filename), "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return filename


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, {"toy/__init__.py": open("toy/__init__.py").read()})


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, {"toy.pth": os.path.abspath(".") + "\\n"})
'''

PYPROJECT = '''[build-system]
requires = []
build-backend = "toy_backend"
backend-path = ["."]

[project]
name = "toy"
version = "{version}"
dependencies = []
'''


def make_project(root: Path, version="0.1.0") -> Path:
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ENV_SH, root / "scripts" / "_env.sh")
    (root / "toy").mkdir()
    (root / "toy" / "__init__.py").write_text("VALUE = 42\n")
    (root / "toy_backend.py").write_text(BACKEND)
    (root / "pyproject.toml").write_text(PYPROJECT.format(version=version))
    return root


def env_sh(root: Path, *args, python=SYSTEM_PY, path=None, **settings):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHON", "NCTV_VENV", "NCTV_REINSTALL", "NCTV_UNPINNED", "VIRTUAL_ENV",
                        "PIP_BREAK_SYSTEM_PACKAGES")}
    env.update(PYTHON=python, NCTV_IMPORT_CHECK="toy", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", **settings)
    if path is not None:
        env["PATH"] = path
    return subprocess.run(["bash", str(root / "scripts" / "_env.sh"), *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)


def venv_run(root: Path, code: str) -> str:
    out = subprocess.run([str(root / ".venv" / "bin" / "python"), "-c", code], capture_output=True, text=True,
                         timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def dist_info(root: Path, version: str) -> Path:
    found = list((root / ".venv" / "lib").glob(f"python3.*/site-packages/toy-{version}.dist-info"))
    assert len(found) == 1, found
    return found[0]


def _probe_pip():
    return subprocess.run([SYSTEM_PY, "-c", "import pip"], capture_output=True).returncode == 0


def test_interpreter_is_checked_and_a_foreign_folder_is_kept(tmp_path):
    root = make_project(tmp_path / "p")
    missing = env_sh(root, python=str(tmp_path / "no-such-python"))
    assert missing.returncode != 0 and "no Python interpreter" in missing.stderr
    old = tmp_path / "python3.9"
    old.write_text(f"#!/bin/sh\necho '3.9.18 {tmp_path}'\n")
    old.chmod(0o755)
    too_old = env_sh(root, python=str(old))
    assert too_old.returncode != 0
    assert "needs Python 3.10 or newer" in too_old.stderr and "3.9.18" in too_old.stderr
    assert not (root / ".venv").exists()
    # A .venv that is not a virtual environment is never deleted.
    (root / ".venv").mkdir()
    (root / ".venv" / "notes.txt").write_text("mine")
    foreign = env_sh(root, python=sys.executable)
    assert foreign.returncode != 0 and "not a virtual environment" in foreign.stderr
    assert (root / ".venv" / "notes.txt").read_text() == "mine"


@needs_system_python
@pytest.mark.slow
def test_system_python_gets_a_venv_and_the_stamp_skips_pip(tmp_path):
    root = make_project(tmp_path / "p")
    marker = list(Path(_SYSTEM[1]).glob(f"lib/python{_SYSTEM[0]}/EXTERNALLY-MANAGED"))
    if marker and _probe_pip():
        # The problem the scripts solve: the system Python refuses pip (dry run: installs nothing).
        refused = subprocess.run([SYSTEM_PY, "-m", "pip", "install", "--dry-run", "--no-index", str(root)],
                                 capture_output=True, text=True, timeout=120,
                                 env={k: v for k, v in os.environ.items() if k != "PIP_BREAK_SYSTEM_PACKAGES"})
        assert refused.returncode != 0 and "externally-managed-environment" in refused.stderr

    assert env_sh(root, "--check").returncode == 1  # nothing there yet
    first = env_sh(root)
    assert first.returncode == 0, first.stderr
    assert "externally-managed" not in first.stdout + first.stderr
    assert "making the virtual environment" in first.stderr and "installing" in first.stderr
    assert first.stdout.strip().splitlines()[-1] == str(root / ".venv" / "bin" / "python")
    cfg = (root / ".venv" / "pyvenv.cfg").read_text()
    assert f"home = {Path(SYSTEM_PY).parent}" in cfg
    base, value, where = venv_run(root, "import sys, toy; print(sys.base_prefix, toy.VALUE, toy.__file__)").split()
    assert base == _SYSTEM[1] and value == "42" and Path(where) == root / "toy" / "__init__.py"
    assert (root / ".venv" / ".nctv-installed-base").is_file()
    assert env_sh(root, "--check").returncode == 0

    # Second run: the stamp matches, pip does not run (the installed metadata is untouched).
    info = dist_info(root, "0.1.0").stat()
    second = env_sh(root)
    assert second.returncode == 0 and "up to date" in second.stderr and "installing" not in second.stderr
    again = dist_info(root, "0.1.0").stat()
    assert (again.st_ino, again.st_mtime_ns) == (info.st_ino, info.st_mtime_ns)

    # A changed pyproject.toml installs again.
    (root / "pyproject.toml").write_text(PYPROJECT.format(version="0.2.0"))
    assert env_sh(root, "--check").returncode == 1
    third = env_sh(root)
    assert third.returncode == 0 and "installing" in third.stderr, third.stderr
    assert venv_run(root, "import importlib.metadata as m; print(m.version('toy'))") == "0.2.0"

    # The test extras (scripts/test.sh) also leave the plain install (scripts/start.sh) up to date.
    assert env_sh(root, "--check", "test").returncode == 1
    tests = env_sh(root, "test")
    assert tests.returncode == 0 and "installing" in tests.stderr and "(.[test])" in tests.stderr, tests.stderr
    assert env_sh(root, "--check", "test").returncode == 0 and env_sh(root, "--check").returncode == 0


@needs_system_python
@pytest.mark.slow
def test_a_broken_venv_is_made_again(tmp_path):
    root = make_project(tmp_path / "p")
    assert env_sh(root).returncode == 0
    python = root / ".venv" / "bin" / "python"
    python.unlink()
    python.symlink_to(tmp_path / "uninstalled" / "python3")  # its interpreter went away
    assert env_sh(root, "--check").returncode == 1
    fixed = env_sh(root)
    assert fixed.returncode == 0, fixed.stderr
    assert "again: its python does not run" in fixed.stderr and "installing" in fixed.stderr
    assert venv_run(root, "import toy; print(toy.VALUE)") == "42"


@needs_system_python
@pytest.mark.slow
def test_constraints_pin_what_is_installed_unless_unpinned(tmp_path):
    root = make_project(tmp_path / "p", version="0.2.0")
    # A pin the project cannot meet shows that pip was held to the file, and that its change counts.
    (root / "constraints.txt").write_text("# tested versions\ntoy==0.1.0\n")
    pinned = env_sh(root)
    assert pinned.returncode != 0 and "conflicting dependencies" in pinned.stderr, pinned.stderr
    (root / "constraints.txt").write_text("toy==0.2.0\n")
    assert env_sh(root).returncode == 0
    assert venv_run(root, "import importlib.metadata as m; print(m.version('toy'))") == "0.2.0"
    (root / "constraints.txt").write_text("toy==0.1.0\n")
    assert env_sh(root, "--check").returncode == 1  # the constraints are part of the stamp
    unpinned = env_sh(root, NCTV_UNPINNED="1")
    assert unpinned.returncode == 0 and "installing" in unpinned.stderr, unpinned.stderr


def _fake(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@needs_system_python
@pytest.mark.slow
def test_a_missing_venv_module_is_installed_with_apt_get(tmp_path):
    """Debian without python3-venv: `python3 -m venv` fails for want of ensurepip. Here a wrapper of
    the system Python fails the same way until a fake apt-get "installs" the package."""
    root = make_project(tmp_path / "p")
    fakes = tmp_path / "bin"
    fakes.mkdir()
    installed, log = tmp_path / "installed", tmp_path / "apt.log"
    version = _SYSTEM[0]
    _fake(fakes / "python3", f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = venv ] && [ ! -e {installed} ]; then
  echo "The virtual environment was not created successfully because ensurepip is not"
  echo "available.  On Debian/Ubuntu systems, you need to install the python3-venv"
  echo "package using the following command."
  echo "    apt install python{version}-venv"
  exit 1
fi
exec {SYSTEM_PY} "$@"
""")
    _fake(fakes / "apt-get", f"""#!/bin/sh
echo "$@" >> {log}
[ "$1" = update ] || touch {installed}
""")
    _fake(fakes / "sudo", '#!/bin/sh\nexec "$@"\n')
    done = env_sh(root, python=str(fakes / "python3"), path=f"{fakes}:{os.environ['PATH']}")
    assert done.returncode == 0, done.stderr
    assert f"installing Debian's python{version}-venv with apt-get" in done.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "update -qq" and calls[1] == f"install -y -qq python{version}-venv"
    assert venv_run(root, "import toy; print(toy.VALUE)") == "42"

    # Without apt-get the message says what to install.
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("bash", "dirname", "sort", "head", "tail", "cat", "rm", "ls", "id", "grep", "env"):
        (tools / tool).symlink_to(shutil.which(tool))
    shutil.copy(fakes / "python3", tools / "python3")
    shutil.rmtree(root / ".venv")
    installed.unlink()
    refused = env_sh(root, python=str(tools / "python3"), path=str(tools))
    assert refused.returncode != 0
    assert f"apt-get install python{version}-venv" in refused.stderr, refused.stderr
    assert not (root / ".venv").exists()
