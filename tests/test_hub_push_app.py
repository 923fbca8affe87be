"""The Calibrate tab's push to the Hub: on a server with sign-in (a Space with ``hf_oauth: true``, where
the Hub sets ``OAUTH_CLIENT_ID``) a signed-in visitor pushes a calibrator of their run to a repository of
their own; elsewhere the panel is absent.

Neither the Hub nor its sign-in can be reached from where this project is built. The launched app
therefore signs in through Gradio's own local sign-in (off a Space, Gradio's login route puts the profile
of the machine's Hub login in the session, read with ``whoami``), and the Hub it asks and pushes to is a
local stand-in of the Hub's HTTP API (tests/hub_standin.py); the app, Gradio and the Hub client are real.
"""
import http.server
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from gradio_client import Client, handle_file

from nctv.ui import limits
from nctv.zoo import DEFAULT_MODEL
from tests.conftest import start_app, stop_app
from tests.hub_standin import committing

pytestmark = pytest.mark.slow

PANEL = {"push-panel", "push-login", "push-button"}


def _ids(url: str) -> set:
    with urllib.request.urlopen(url + "config", timeout=30) as r:
        config = json.loads(r.read())
    return {c["props"].get("elem_id") for c in config["components"]}


def test_without_sign_in_there_is_no_push_panel(server):
    ids = _ids(server)
    assert not PANEL & ids
    assert "calibrate-files" in ids  # the downloads it would sit under are there


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def _sign_in(url: str) -> str:
    """The session cookie of a visitor who signed in (the login route, then its callback)."""
    opener = urllib.request.build_opener(_NoRedirects)
    where = url + "login/huggingface"
    for _ in range(3):
        try:
            opener.open(where, timeout=30)
        except urllib.error.HTTPError as e:
            if e.code not in (302, 303, 307):
                raise
            cookie = e.headers.get("set-cookie")
            if cookie:
                return cookie.split(";")[0]
            where = urllib.parse.urljoin(url, e.headers["location"])
    raise AssertionError("the sign-in set no session cookie")


@pytest.fixture(scope="module")
def signed_in_app(tmp_path_factory):
    repos = {}
    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), committing(repos))
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    tmp = tmp_path_factory.mktemp("signed-in")
    proc, url = start_app(tmp, OAUTH_CLIENT_ID="stand-in-client", OAUTH_CLIENT_SECRET="stand-in-secret",
                          OAUTH_SCOPES="openid profile write-repos manage-repos", HF_TOKEN="hf_stand_in",
                          HF_ENDPOINT=f"http://127.0.0.1:{hub.server_address[1]}", HF_HUB_OFFLINE="0")
    yield url, repos
    stop_app(proc)
    hub.shutdown()


def test_a_signed_in_visitor_pushes_a_calibrator_of_their_run_to_their_own_repository(signed_in_app):
    from huggingface_hub import ModelCard

    url, repos = signed_in_app
    assert PANEL <= _ids(url)
    visitor = Client(url, verbose=False, headers={"Cookie": _sign_in(url)})
    shared = (DEFAULT_MODEL, "", limits.DEFAULT_DATASET_CHOICE, 300, 1000, 0, 15)
    *_, files = visitor.predict(*shared, ["Temperature Scaling"], "1", "auto", "random", "fast", 100,
                                api_name="/calibrate")
    results = json.loads(Path(next(f for f in files if f.endswith("results.json"))).read_text())
    status = visitor.predict([handle_file(f) for f in files], "Temperature Scaling", "fmnist-ts", False,
                             api_name="/push_calibrator")
    assert status.startswith("**Pushed** Temperature Scaling to [visitor/fmnist-ts]")
    [commit] = repos["visitor/fmnist-ts"]
    assert set(commit) == {"README.md", "config.json", "calibrator.safetensors", "reliability.png"}
    card = ModelCard(commit["README.md"].decode())
    ece = {r.metric_type: r.metric_value for r in card.data.eval_results}["ece"]
    assert ece == results["methods"]["Temperature Scaling"]["metrics"]["15"]["ece"]["mean"]
    assert json.loads(commit["config.json"])["method"] == "Temperature Scaling"


def test_a_visitor_who_did_not_sign_in_is_asked_to(signed_in_app):
    url, repos = signed_in_app
    before = {k: len(v) for k, v in repos.items()}
    with pytest.raises(Exception, match="Sign in with Hugging Face first"):
        Client(url, verbose=False).predict([], "Temperature Scaling", "mine", False, api_name="/push_calibrator")
    assert {k: len(v) for k, v in repos.items()} == before
