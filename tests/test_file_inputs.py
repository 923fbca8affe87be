"""Every file input of the app takes only files uploaded to it: a web address or another path of the
server is refused in words before anything is fetched or read, whatever the input, the endpoint (public
or the page's own) or the route (gradio_client, a raw ``/gradio_api/call`` or ``queue/join`` body).

Gradio downloads a web address named as a file before a handler runs, so "nothing fetched" is measured:
the launched app's proxy (``HTTP_PROXY``, ``HTTPS_PROXY``) is a server of this test on 127.0.0.1 that
records every request it gets. Gradio's downloads of Hugging Face addresses go through the proxy (its
other hosts only after a DNS look-up through it), and so does any other web request of the server; a
file named by that server's own address would reach it directly.
"""
import http.server
import json
import os
import re
import threading
import urllib.parse
import uuid

import numpy as np
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

from test_browser import CHROMIUM, browser, open_app  # noqa: F401 - browser: a fixture
from test_hostile_small import App, _apps_words, launched

from nctv.ui.uploads import UPLOAD_FIRST, uploaded, uploads_only

#: Web addresses named as files: a Hugging Face one, which Gradio fetches through the proxy unasked
#: (its host is on Gradio's list of hosts that skip the check of private addresses); another host.
WEB = ("http://huggingface.co/datasets/x/resolve/main/logits.npz", "https://hf.co/x/resolve/main/boot.png",
       "https://example.com/logits.npz")
REFUSED = "which is not a file uploaded to this app. " + UPLOAD_FIRST


def _file(path: str, name: str = "file") -> dict:
    return {"path": path, "orig_name": name, "meta": {"_type": "gradio.FileData"}}


# --------------------------------------------------------------------------- the check (in process)


@pytest.fixture
def upload_folder():
    from gradio.utils import get_upload_folder

    folder = get_upload_folder()
    os.makedirs(folder, exist_ok=True)
    return folder


@pytest.fixture
def an_upload(upload_folder):
    """A file in Gradio's upload folder, with a space in its name (an address writes it %20)."""
    path = os.path.join(upload_folder, f"test-{uuid.uuid4().hex} logits.npz")
    with open(path, "wb") as f:
        f.write(b"x")
    yield path
    os.unlink(path)


@pytest.mark.parametrize("named", [*WEB, "/etc/passwd", "{uploads}/../../etc/passwd", "{uploads}", "{uploads}/none.npz",
                                   "http://app/gradio_api/file=/etc/passwd",
                                   "http://app/gradio_api/file={uploads}/../../etc/passwd",
                                   "file:///etc/passwd", "assets/precomputed/test_logits.safetensors", "a\0b", "x" * 5000])
def test_a_file_not_uploaded_to_this_app_is_refused_in_words(named, upload_folder):
    import gradio as gr

    with pytest.raises(gr.Error) as refused:
        uploaded(named.format(uploads=upload_folder), "Logits and labels")
    message = refused.value.message
    assert message.startswith("Logits and labels names ") and message.endswith(REFUSED), message
    assert upload_folder not in message
    _apps_words(message)


def test_a_link_in_the_upload_folder_leads_nowhere_else(upload_folder, tmp_path):
    import gradio as gr

    link = os.path.join(upload_folder, f"test-{uuid.uuid4().hex}.png")
    os.symlink("/etc/passwd", link)
    try:
        with pytest.raises(gr.Error, match="not a file uploaded to this app"):
            uploaded(link)
    finally:
        os.unlink(link)


def test_an_upload_is_named_by_its_path_or_by_the_apps_address_of_it(an_upload):
    assert uploaded(an_upload) == an_upload
    for host in ("http://127.0.0.1:7860", "https://someone-nctv.hf.space"):
        assert uploaded(f"{host}/gradio_api/file={urllib.parse.quote(an_upload)}") == an_upload


def test_every_file_in_every_value_is_checked_and_the_servers_state_is_not(an_upload):
    """A drawing's layers, a list of files, a file sent to a text input: Gradio would move each."""
    import gradio as gr

    class Input:
        label, stateful = "Drawing", False

    class State:
        label, stateful = None, True

    address = f"http://app/gradio_api/file={urllib.parse.quote(an_upload)}"
    drawing = {"background": None, "layers": [_file(an_upload), _file(address)], "composite": _file(address), "id": None}
    checked = uploads_only([Input(), Input(), State()], [drawing, "text", _file(WEB[0])], lambda b: b.label)
    assert [layer["path"] for layer in checked[0]["layers"]] == [an_upload, an_upload]
    assert checked[0]["composite"]["path"] == an_upload and checked[1:] == ["text", _file(WEB[0])]
    with pytest.raises(gr.Error) as refused:
        uploads_only([Input()], [{"layers": [_file(an_upload), _file(WEB[1])]}], lambda b: b.label)
    assert refused.value.message.startswith(f"Drawing names the web address {WEB[1]!r}, {REFUSED}")


# --------------------------------------------------------------------------- the launched app


class Recorder(http.server.BaseHTTPRequestHandler):
    """Answers every request with 502 and records its first line (a proxied GET names the whole
    address; a proxied https request is a CONNECT)."""

    seen: list[str] = []

    def _record(self):
        type(self).seen.append(self.requestline)
        self.send_response(502)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_POST = do_PUT = do_CONNECT = _record

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def recorder():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def app(tmp_path_factory, recorder):
    tmp = tmp_path_factory.mktemp("file-inputs")
    proxy = {name: recorder for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    # The server's calls to itself (the agents' tools run through its own queue) stay off the proxy.
    yield from launched(tmp, NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", **proxy)


@pytest.fixture
def nothing_fetched():
    """The test's calls reach no web server: the recorder is asked nothing while it runs."""
    Recorder.seen.clear()
    yield
    assert Recorder.seen == []


def _logits_npz(tmp_path) -> bytes:
    rng = np.random.default_rng(0)
    path = tmp_path / "logits.npz"
    np.savez(path, logits=rng.normal(size=(200, 3)) * 3, labels=rng.integers(0, 3, 200))
    return path.read_bytes()


def _ask(app: App, fn: int, data: list, queued: bool) -> str | None:
    """The error message of one call of event ``fn`` as the page makes it, or None if it ran."""
    session = uuid.uuid4().hex[:12]
    body = {"data": data, "fn_index": fn, "session_hash": session}
    if not queued:
        return app.http.post("/gradio_api/run/predict", json=body).json().get("error")
    app.http.post("/gradio_api/queue/join", json=body).raise_for_status()
    done = list(app.messages(session, until="process_completed", timeout=None))[-1]
    return None if done["success"] else done["output"].get("error")


@pytest.mark.parametrize("named", [WEB[0], "server path"])
def test_every_event_refuses_a_file_that_was_not_uploaded_in_every_input(app, named, nothing_fetched):
    """Each event the page can trigger (public or not: the calibrators' .zip, a shipped example, the Try
    tab's picture and drawing, the logits upload, the agents' tools …) sent a web address, or a file of
    the server, in every value as a file, as a hostile client can: each is refused in words, and none
    runs."""
    file = _file(named if named in WEB else os.path.realpath(app.log))  # the server's log: it exists
    answers = {}
    for dep in app.config["dependencies"]:
        if dep.get("backend_fn") and dep["inputs"]:
            answers[dep["id"]] = _ask(app, dep["id"], [file] * len(dep["inputs"]), dep.get("queue") is not False)
    stateful = {c["id"] for c in app.config["components"] if c["type"] == "state"}
    asked = [fn for fn, dep in enumerate(app.config["dependencies"])
             if fn in answers and set(dep["inputs"]) - stateful]
    assert len(asked) > 20
    for fn in asked:
        message = answers[fn]
        assert message is not None and message.endswith(REFUSED), (fn, message)
        _apps_words(message)


@pytest.mark.parametrize("named", WEB)
def test_gradio_clients_web_address_is_refused_before_it_is_fetched(app, recorder, named, nothing_fetched):
    client = Client(app.url, verbose=False)
    calls = {"/calibrate_logits": (handle_file(named), ["Temperature Scaling"], 15, 0, "lac", 90),
             "/classify": (handle_file(named), "gaussian-noise", 0),
             "/classify_drawing": ({"background": None, "layers": [handle_file(named)], "composite": None}, "gaussian-noise", 0),
             "/mcp_classify": (handle_file(named),)}
    for api, args in calls.items():
        with pytest.raises(AppError) as refused:
            client.predict(*args, api_name=api)
        assert f"names the web address {named!r}, {REFUSED}" in str(refused.value), (api, str(refused.value))


def test_this_servers_own_address_and_its_files_are_refused(app, recorder, nothing_fetched):
    """A raw call naming the recorder (a server on this machine, as a private address would be), Gradio's
    file route for a file it serves but nobody uploaded, and files of the server by path."""
    from nctv.ui.shipped import examples_dir

    example = sorted(examples_dir().iterdir())[0]
    for named in (f"{recorder}/logits.npz", f"{app.url}/gradio_api/file={example}", "/etc/passwd", str(example),
                  "gradio-cache/../../../etc/passwd"):
        kind, message = app.call("calibrate_logits", [_file(named), ["Temperature Scaling"], 15, 0, "lac", 90])
        assert kind == "error" and message.startswith("Logits and labels names ") and message.endswith(REFUSED), message
        assert "root:" not in message
        kind, message = app.call("classify", [_file(named, "boot.png")])
        assert kind == "error" and message.startswith("Upload, paste or take a picture names "), message


def test_an_upload_is_read_by_its_path_or_by_the_apps_address_of_it(app, tmp_path, nothing_fetched):
    """What this app was given still works: a logits upload by its address (as an agent's upload tool
    gives it) and by its path, a picture through gradio_client, and the shipped example the page shows."""
    path = app.upload("logits.npz", _logits_npz(tmp_path))
    for named in (f"{app.url}/gradio_api/file={urllib.parse.quote(path)}", path):
        kind, out = app.call("calibrate_logits", [_file(named, "logits.npz"), ["Temperature Scaling"], 15, 0, "lac", 90])
        assert kind == "complete" and out[0].startswith("**Done**") and "logits.npz" in out[0], out[0]
    from nctv.ui.try_image import example_images

    answer = Client(app.url, verbose=False).predict(handle_file(example_images()[0]), "gaussian-noise", 0,
                                                    api_name="/classify")
    assert "The model's answer" in answer[1]
    shown = next(c["props"]["value"] for c in app.config["components"] if c["props"].get("elem_id") == "try-image")
    assert shown["path"].startswith("gradio-cache/")  # the page's value: a copy in Gradio's upload folder
    kind, out = app.call("classify", [shown])
    assert kind == "complete" and "The model's answer" in out[1]


@pytest.mark.browser
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs Debian's Chromium at {CHROMIUM}")
def test_a_shipped_example_picked_in_the_page_is_classified(app, browser, nothing_fetched):  # noqa: F811
    """The page sends a shipped example as Gradio's copy of it in the upload folder: picking one in the
    Try tab shows the answer the API gives for that copy."""
    samples = next(c["props"]["samples"] for c in app.config["components"]
                   if c["type"] == "dataset" and c["props"].get("label") == "Or pick a shipped example")
    kind, out = app.call("classify", [samples[2][0]])
    assert kind == "complete"
    expected = re.findall(r'data-confidence="([^"]+)"', out[1])
    pg = open_app(browser, app.url + "/", 1280, 720)
    try:
        pg.get_by_role("tab", name="Try your own image").click()
        pg.wait_for_selector("#try-chart .nctv-class")
        pg.locator("#try-more .gallery-item").nth(2).click()
        pg.wait_for_function("""expected => JSON.stringify([...document.querySelectorAll('#try-chart [data-confidence]')]
                                .map(bar => bar.dataset.confidence)) === JSON.stringify(expected)""", arg=expected)
    finally:
        pg.context.close()
