"""The small things a hostile visitor found: every refusal in the app's words (zip member names, values
no input takes, pictures a decoder balks at, calls with too few values), numbers written only in
ASCII digits and whole where they must be, a cancelled run whose page is told, and an aborted upload
that costs the log one line. The server's behaviour is checked on the launched app (``python app.py``).
"""
import io
import json
import logging
import re
import socket
import time
import uuid
import zipfile
from pathlib import Path

import httpx
import numpy as np
import PIL.Image
import pytest

from conftest import start_app, stop_app
from test_hostile_http import Server

from nctv.cli import build_parser
from nctv.settings import NCOptions
from nctv.ui.upload_calibrator import calibration_from_zip, load_calibrators
from nctv.zoo import DEFAULT_MODEL

#: What a framework's or Python's own message shows, which the app's never does.
NOT_THE_APPS = re.compile(r"0x[0-9a-f]{6,}|object at|Traceback|object has no attribute|unhashable|validation error"
                          r"|Something went wrong|Could not preprocess|Errno|nctv-upload-|/tmp/|decoder|truncated")


def _apps_words(message: str) -> None:
    assert not NOT_THE_APPS.search(message), message
    assert len(message) <= 600, message


# --------------------------------------------------------------------------- zips (in process)


def _zip(path: Path, names: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name in names:
            z.writestr(name, b"{}")
    return path


@pytest.mark.parametrize("names, words", [
    (["a" * 10_000 + "/config.json"], "whose name is 10,012 bytes long"),
    (["é" * 150 + "/config.json"], "whose name is 312 bytes long"),  # under 255 characters, over 255 bytes
    (["x/config.json", "x/config.json/config.json"], "'x/config.json' both as a file and as a folder"),
    (["x/config.json/config.json", "x/config.json"], "'x/config.json' both as a file and as a folder"),
    (["x/config.json", "x/config.json"], "'x/config.json' twice"),
])
def test_a_zip_whose_names_clash_or_are_too_long_is_refused_in_words(names, words, tmp_path, caplog):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate it writes
        archive = _zip(tmp_path / "calibrators.zip", names)
    with caplog.at_level(logging.INFO, logger="nctv.ui"), pytest.raises(Exception) as refused:
        load_calibrators(str(archive), None)
    message = str(refused.value)
    assert words in message and "it was not made by NCTV" in message
    _apps_words(message)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # no traceback in the log


def test_a_zip_refusal_names_its_file_as_the_zip_does(tmp_path):
    # A config.json that is no calibrator's: the message names it by its place in the zip.
    archive = _zip(tmp_path / "calibrators.zip", ["neural-clamping-fl/config.json"])
    with pytest.raises(ValueError) as refused:
        calibration_from_zip(archive, None)
    assert str(refused.value).startswith("neural-clamping-fl/config.json is not a saved NCTV calibrator")
    _apps_words(str(refused.value))


# --------------------------------------------------------------------------- numbers (in process)


@pytest.mark.parametrize("setting, text", [
    ("gamma", "٣"),  # Arabic-Indic three: float() reads it as 3
    ("gamma", "３"),  # full-width three
    ("lr", "１e-3"),  # full-width one
    ("weight_decay", "1_0"),  # float() reads it as 10
])
def test_a_typed_setting_is_read_from_ascii_digits_only(setting, text):
    with pytest.raises(ValueError) as refused:
        NCOptions(fitter="paper", **{setting: text})
    assert repr(text) in str(refused.value)
    ascii_ = text.translate(str.maketrans("٣３１", "331")).replace("_", "")
    assert NCOptions(fitter="paper", **{setting: ascii_}).setting(setting) == float(ascii_)


@pytest.mark.parametrize("args, flag", [
    (["run", "--calibration-seed", "٣"], "--calibration-seed"),
    (["run", "--seeds", "１"], "--seeds"),
    (["run", "--batch-size", "1_000"], "--batch-size"),
    (["sweep-gamma", "--gammas", "٠.٥"], "--gammas"),
])
def test_the_command_reads_ascii_digits_only(args, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {flag}: expected a" in err and repr(args[-1]) in err


class _Counted:
    """A value that counts how often it is written out."""

    calls = 0

    def __repr__(self) -> str:
        type(self).calls += 1
        return "v"


def test_a_message_writes_out_only_the_part_of_a_value_it_shows():
    # A sent list of 10,000 values (the JSON cap) is named by its first items; the rest are never
    # turned into text, as they were when the whole repr was built and then cut.
    from nctv.checks import ECHO_CHARS, shown
    _Counted.calls = 0
    text = shown([[_Counted() for _ in range(100)] for _ in range(100)])
    assert text.startswith("[[v, v, v") and len(text) <= ECHO_CHARS + 1
    assert 0 < _Counted.calls <= 20 * 20
    assert shown(["fashion-mnist"]) == "['fashion-mnist']" and shown(1.5) == "1.5"
    assert shown("x" * 500) == repr("x" * ECHO_CHARS) + "…"


def test_an_environment_cap_in_other_digits_stops_the_app_in_words(monkeypatch):
    from nctv.checks import env_limit

    monkeypatch.setenv("NCTV_TEST_CAP", "５０")
    with pytest.raises(ValueError, match="NCTV_TEST_CAP must be a whole number"):
        env_limit("NCTV_TEST_CAP", 10)


# --------------------------------------------------------------------------- the launched app


class App(Server):
    """The launched app, its log, and the page's side of the queue (join, the event stream)."""

    def __init__(self, proc, url: str, log: Path):
        super().__init__(proc, url)
        self.log = log
        self.config = self.http.get("/config").json()

    def fn(self, api_name: str) -> int:
        return next(d["id"] for d in self.config["dependencies"] if d.get("api_name") == api_name)

    def messages(self, session: str, until: str, timeout: float = 60):
        with self.http.stream("GET", f"/gradio_api/queue/data?session_hash={session}", timeout=timeout) as s:
            for line in s.iter_lines():
                if line.startswith("data:"):
                    message = json.loads(line[5:])
                    yield message
                    if message.get("msg") == until:
                        return

    def file(self, name: str, data: bytes) -> dict:
        return {"path": self.upload(name, data), "orig_name": name, "meta": {"_type": "gradio.FileData"}}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    yield from launched(tmp_path_factory.mktemp("small"))


def launched(tmp: Path, **env):
    """The app launched in ``tmp`` with ``env`` added (an :class:`App`), stopped when the caller is done."""
    proc, url = start_app(tmp, **env)
    served = App(proc, url, tmp / "server.log")
    try:
        yield served
    finally:
        served.http.close()
        stop_app(proc)


def _calibrate(**changes) -> list:
    """The calibrate endpoint's 16 values: a small, quick run, with ``changes`` by field name."""
    fields = dict(model=DEFAULT_MODEL, hub_id="", dataset="model's own dataset", calibration_size=20, test_size=20,
                  seed=0, bins=5, methods=["Temperature Scaling"], gamma="1", weight_decay="default", init="random",
                  fitter="fast", epochs=10, lr="default", conformal_score="lac", coverage=90)
    fields.update(changes)
    return list(fields.values())


@pytest.mark.parametrize("changes, words", [
    ({"calibration_size": 20.5}, "Calibration size (images) must be a whole number; got 20.5."),
    ({"epochs": 10.25}, "Epochs (recipes only) must be a whole number; got 10.25."),
    ({"bins": 7.5}, "Bins (ECE, AECE, SCE) must be a whole number from 5 to 50; got 7.5."),
    ({"gamma": "٣"}, "Focal-loss gamma (γ) must be a number from 0 to 10"),
    ({"fitter": "paper", "lr": "１e-3"}, "The learning rate must be 'default'"),
    ({"dataset": ["fashion-mnist"]}, "Calibration pool (dataset) must be text; got ['fashion-mnist']."),
    ({"hub_id": ["timm/resnet18"]}, "…or your own Hugging Face Hub model id must be text; got ['timm/resnet18']."),
    ({"gamma": {"value": 1}}, "Focal-loss γ must be text; got {'value': 1}."),
    ({"conformal_score": "thr"}, "Score must be one of: lac, aps, raps; got 'thr'."),
    ({"conformal_score": ["aps"]}, "Score must be one of: lac, aps, raps; got ['aps']."),
    ({"coverage": 100}, "Coverage (%) must be a whole number from 50 to 99; got 100."),
    ({"coverage": 95.5}, "Coverage (%) must be a whole number from 50 to 99; got 95.5."),
    ({"coverage": "95"}, "Coverage (%) must be a whole number from 50 to 99; got '95'."),
])
def test_a_value_the_setting_cannot_take_is_refused_in_the_apps_words(app, changes, words):
    kind, message = app.call("calibrate", _calibrate(**changes))
    assert kind == "error" and words in message, message
    _apps_words(message)


def test_a_whole_number_is_whole(app):
    kind, message = app.call("calibrate", _calibrate(seed=1.5))  # Gradio's number box ran it as seed 2
    assert (kind, message) == ("error", "Seed must be a whole number; got 1.5.")
    kind, out = app.call("calibrate", _calibrate(seed=3.0, calibration_size=20.0))  # whole, written as a float
    assert kind == "complete" and out[0].startswith("**Done**"), out[0]


def test_too_few_values_are_named_without_the_servers_internals(app):
    kind, message = app.call("calibrate", _calibrate()[:3])
    assert kind == "error" and message.startswith("/calibrate takes these values, in this order: Model, …or your own "
                                                  "Hugging Face Hub model id, Calibration pool (dataset),"), message
    _apps_words(message)
    kind, message = app.call("explore_temperature", [])
    assert kind == "error" and "Temperature T, Bins" in message
    _apps_words(message)


def test_every_event_refuses_a_list_in_every_input_in_words(app):
    """Each event the page can trigger (public or not) sent a list for each value, as a hostile
    client can: the answer is the app's sentence."""
    answers = {}
    for dep in app.config["dependencies"]:
        if not dep.get("backend_fn"):
            continue
        session = uuid.uuid4().hex[:12]
        body = {"data": [["x"]] * len(dep["inputs"]), "fn_index": dep["id"], "session_hash": session}
        if dep.get("queue") is False:
            answer = app.http.post("/gradio_api/run/predict", json=body).json()
            answers[dep["id"]] = answer.get("error")
        else:
            app.http.post("/gradio_api/queue/join", json=body).raise_for_status()
            done = list(app.messages(session, until="process_completed"))[-1]
            answers[dep["id"]] = None if done["success"] else done["output"].get("error")
    assert len(answers) > 20
    for fn, message in answers.items():
        if message is not None:
            _apps_words(message)


def _saved(img: PIL.Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt)
    return out.getvalue()


def test_every_picture_refusal_is_the_apps_sentence(app):
    rgb = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 28, 3), dtype=np.uint8))
    pictures = {
        "lab.tif": (_saved(PIL.Image.new("LAB", (28, 28)), "TIFF"), "is not an image this app can read"),
        "float.tif": (_saved(PIL.Image.new("F", (28, 28)), "TIFF"), "is not an image this app can read"),
        "cut.png": (_saved(rgb, "PNG")[:70], "could not be decoded; it may be damaged or cut short"),
        "cut.webp": (_saved(rgb, "WEBP")[:40], "could not be decoded; it may be damaged or cut short"),
    }
    for name, (data, words) in pictures.items():
        kind, message = app.call("classify", [app.file(name, data), "gaussian-noise", 0])
        assert kind == "error" and words in message, (name, message)
        _apps_words(message)


def test_a_cancel_that_names_no_event_still_ends_the_stopped_runs_page(app):
    """Gradio's cancel route stops every run of (session, event number) but ends the stream of the event
    it names only: a cancel naming none left the stopped run's page waiting for ever."""
    session = uuid.uuid4().hex[:12]
    fn = app.fn("calibrate")
    # A slow run: the paper's recipe for 1000 epochs.
    slow = _calibrate(calibration_size=2000, methods=["Neural Clamping (FL)"], fitter="paper", epochs=1000)
    app.http.post("/gradio_api/queue/join", json={"data": slow, "fn_index": fn, "session_hash": session})
    seen, stopped_at, cancelled_at = [], [], []
    messages = app.messages(session, until="process_completed", timeout=60)
    for message in messages:
        seen.append(message)
        if cancelled_at and time.monotonic() - cancelled_at[0] > 30:
            break  # the stream only brings heartbeats: the page would wait for ever
        if message.get("msg") == "process_generating" and not cancelled_at:
            cancelled_at.append(time.monotonic())
            r = app.http.post("/gradio_api/cancel", json={"session_hash": session, "fn_index": fn,
                                                          "event_id": "not-the-runs"})
            assert r.status_code == 200
    stopped_at.append(time.monotonic())
    last = seen[-1]
    assert cancelled_at and last["msg"] == "process_completed" and last["success"], last
    assert last["output"]["data"][0].startswith("**Stopped.**")  # the status line says so, as after Stop
    assert stopped_at[0] - cancelled_at[0] < 20
    messages.close()


def test_no_server_path_in_the_page_or_the_apps_description(app):
    from gradio.utils import get_upload_folder

    folder = get_upload_folder()  # the server's, as this process has the same settings
    for route in ("/", "/config", "/gradio_api/info"):
        text = app.http.get(route).text
        assert folder not in text and "/tmp/" not in text and "gradio-cache/" in text, route
    # The shipped example is fetched and classified under the alias, as the page does.
    image = next(c for c in app.config["components"] if c["props"].get("elem_id") == "try-image")["props"]["value"]
    assert image["path"].startswith("gradio-cache/") and "/file=gradio-cache/" in image["url"]
    fetched = app.http.get(image["url"])
    assert fetched.status_code == 200 and fetched.content.startswith(b"\x89PNG")
    kind, out = app.call("classify", [image, "gaussian-noise", 0])
    assert kind == "complete" and "The model's answer" in out[1]


def test_an_aborted_upload_costs_the_log_one_line_at_most(app):
    before = app.log.read_text(errors="replace")
    body = (b"--b\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a.png\"\r\n"
            b"Content-Type: image/png\r\n\r\n" + bytes(100_000))
    head = (f"POST /gradio_api/upload HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            f"Content-Length: {len(body) + 500_000}\r\n\r\n").encode()
    host, port = app.url.split("//")[1].split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(head + body)
            time.sleep(0.3)
    time.sleep(1.0)
    app.http.get("/config")  # the server still answers
    added = app.log.read_text(errors="replace")[len(before):]
    assert "Traceback" not in added and "ClientDisconnect" not in added, added[-2000:]
    assert len(added.strip().splitlines()) <= 3, added
