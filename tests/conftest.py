"""Fixtures shared by the test modules: torch settings, the default model and the launched app.

The expensive parts are session-scoped: the default model is loaded once (it is frozen: eval mode, no
gradients, so no test can change it for another), and one ``python app.py`` serves both the client
tests and the browser tests (each gradio_client and each browser page is its own visitor with its
own state on the server, so one module's runs never show up in another's).
"""
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

#: How long a browser test waits for something the page or the server does (a status line, a figure, a
#: download), in ms. The wait ends as soon as that happens; this deadline only ends a test whose event
#: never comes. A busy machine (another job on both cores) needs minutes where an idle one needs
#: seconds, so it is long; ``NCTV_TEST_WAIT_S`` sets another.
PAGE_WAIT_MS = int(float(os.environ.get("NCTV_TEST_WAIT_S", "900")) * 1000)

# The suite runs on small CPUs; two threads are plenty and keep runs repeatable.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of small problems (a second only adds hand-off overhead);
    use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def default_model():
    from nctv.zoo import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL)


@pytest.fixture
def local_hub(tmp_path, monkeypatch):
    """``serve(handler)``: the Hub client of this process talks to a local HTTP server run by
    ``handler`` (the Hub cannot be reached from where this project is built), with an empty cache
    and no proxy; the server stops when the test ends."""
    from huggingface_hub import constants

    servers = []

    def serve(handler: type[http.server.BaseHTTPRequestHandler]) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.delenv(name, raising=False)
        # The client builds download addresses from a template fixed at import, so both are redirected.
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        return endpoint

    yield serve
    for server in servers:
        server.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(tmp: Path, timeout: float = 600.0, base_env: dict | None = None, **extra_env: str):
    """Start ``python app.py`` offline on a free port (``base_env``: its environment, default this
    process's; ``extra_env``: more variables, which override these); returns (process, url) once it
    answers. It is waited for while it runs (a busy machine starts it slowly); ``timeout`` only bounds
    a server that never answers."""
    port = free_port()
    env = dict(os.environ if base_env is None else base_env, PORT=str(port), GRADIO_SERVER_NAME="127.0.0.1",
               NCTV_CACHE_DIR=str(tmp / "cache"), HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
               MPLCONFIGDIR=str(tmp / "mpl"))
    env.update(extra_env)
    log = open(tmp / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    _SERVERS[proc] = (url, tmp / "server.log")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"app.py exited with {proc.returncode}:\n{(tmp / 'server.log').read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"app.py did not answer within {timeout:.0f} s:\n{(tmp / 'server.log').read_text()[-3000:]}")


#: Servers start_app launched and stop_app has not stopped: process -> (url, log file).
_SERVERS: dict = {}


def stop_app(proc) -> None:
    _SERVERS.pop(proc, None)
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The URL of the one app server of the session (started on first use)."""
    proc, url = start_app(tmp_path_factory.mktemp("app"))
    yield url
    stop_app(proc)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report says which launched server has ended on its own, how (exit status or
    signal) and the last lines of its log: a server that vanishes otherwise leaves only "connection refused"."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    for proc, (url, log) in list(_SERVERS.items()):
        code = proc.poll()
        if code is None:
            continue
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        try:
            tail = log.read_text(errors="replace")[-4000:]
        except OSError as e:
            tail = f"(its log could not be read: {e})"
        report.sections.append((f"app.py at {url} ended on its own ({how})", tail))
