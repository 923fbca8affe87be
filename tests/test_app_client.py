"""The app launched for real (``python app.py`` on a free local port; the session's server from
conftest.py, shared with the browser tests) and driven through its API with gradio_client: every
public endpoint answers with the right types and plausible values, bad input gets a clear message,
and the server keeps serving afterwards."""
import html
import json
import os
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image
from safetensors import safe_open

from nctv import metrics
from nctv.data import get_splits
from nctv.inference import model_logits
from nctv.ui import limits, shipped
from nctv.ui.try_image import example_images
from nctv.zoo import DEFAULT_MODEL

PUBLIC = {"/calibrate", "/calibrate_logits", "/gamma_sweep", "/init_study", "/classify", "/classify_drawing",
          "/explore_temperature",
          # the agents' tools (tests/test_mcp.py)
          "/mcp_calibrate_logits", "/mcp_calibration_test", "/mcp_classify", "/mcp_explain_temperature"}
SHARED = (DEFAULT_MODEL, "", limits.DEFAULT_DATASET_CHOICE, 300, 1000, 0, 15)


@pytest.fixture(scope="module")
def client(server):
    return Client(server, verbose=False)


def test_exactly_the_public_endpoints_are_listed(client):
    api = client.view_api(return_format="dict", print_info=False)
    assert set(api["named_endpoints"]) == PUBLIC
    assert not api["unnamed_endpoints"]
    params = [p["parameter_name"] for p in api["named_endpoints"]["/calibrate"]["parameters"]]
    assert params == ["model", "hub_id", "dataset", "calibration_size", "test_size", "seed", "n_bins", "methods",
                      "gamma", "weight_decay", "init", "fitter", "epochs", "lr", "conformal_score", "coverage"]
    # Older calls (of gradio_client, which sends the defaults of what a call leaves out) still work.
    lr, score, coverage = api["named_endpoints"]["/calibrate"]["parameters"][-3:]
    assert lr["parameter_has_default"] and lr["parameter_default"] == "default"
    assert (score["parameter_default"], coverage["parameter_default"]) == ("lac", 90)
    params = [p["parameter_name"] for p in api["named_endpoints"]["/calibrate_logits"]["parameters"]]
    assert params == ["file", "methods", "n_bins", "seed", "conformal_score", "coverage"]


def test_queue_settings(server):
    with urllib.request.urlopen(server + "config", timeout=10) as r:
        config = json.load(r)
    deps = {d["api_name"]: d for d in config["dependencies"]}
    # Every endpoint goes through the queue (the Learn tab's slider redraws in the page, without the server).
    assert all(deps[name]["queue"] for name in ("calibrate", "gamma_sweep", "init_study", "classify",
                                                "explore_temperature"))
    assert config["max_file_size"] == 25 * 1024 * 1024


def test_explore_temperature_matches_metrics_of_the_shipped_logits(client):
    pre = shipped.load_precomputed()
    z, y = pre.result.methods["Uncalibrated"].test_logits, pre.result.test_labels
    plot, table, text = client.predict(1.5, 12, api_name="/explore_temperature")
    assert plot["type"] == "plotly" and json.loads(plot["plot"])["data"]
    line = next(ln for ln in table.splitlines() if ln.startswith("| T = 1.50 (slider) |"))
    ece = float(line.strip("|").split("|")[3])
    assert ece == pytest.approx(round(100 * metrics.ece(z / 1.5, y, 12), 2))
    assert "ECE" in text and "12 bins" in text
    # Out of range: a message in words, not a server error.
    with pytest.raises(AppError, match="between 0.05 and 5"):
        client.predict(7, 15, api_name="/explore_temperature")


def _check_chart(page, methods=("raw", "ts", "nc")):
    """A confidence chart (HTML): at least five classes, each with one bar per method, probabilities
    (data-confidence) from 0 to 1 shown as percentages with one decimal, the most likely
    (uncalibrated) class first; returns {class: {method: probability}}."""
    assert isinstance(page, str) and page.startswith('<div class="nctv-chart'), page
    rows = {}
    for part in page.split('<div class="nctv-class" data-class="')[1:]:
        bars = re.findall(r'data-method="(\w+)" data-confidence="([^"]*)".*?<span class="nctv-value">([^<]*)<', part)
        assert tuple(m for m, _, _ in bars) == methods
        for _, p, shown in bars:
            shown = html.unescape(shown)
            # The number and its unit (and "<", ">" and the number) joined by non-breaking spaces.
            assert 0.0 <= float(p) <= 1.0 and re.fullmatch(r"([<>]\u00a0)?\d{1,3}\.\d\u00a0%", shown)
            assert shown[0] in "<>" or float(shown[:-2]) == pytest.approx(100 * float(p), abs=0.05)
        rows[html.unescape(part.split('"', 1)[0])] = {m: float(p) for m, p, _ in bars}
    assert len(rows) >= 5
    raw = [bars["raw"] for bars in rows.values()]
    assert raw == sorted(raw, reverse=True)
    for m in methods:
        assert sum(bars[m] for bars in rows.values()) <= 1.0 + 1e-9
    return rows


def _top(rows, method):
    return max(rows, key=lambda c: rows[c][method])


def test_classify_an_example(client):
    verdict, chart, view, note = client.predict(handle_file(example_images()[0]), api_name="/classify")
    assert shipped.PRECOMPUTED_LABEL in note and "This model knows 10 classes" in note
    assert "looks like the data the model knows" in verdict and 'data-flagged="false"' in verdict
    assert 'data-delta="[' in view and "<canvas" in view
    # Temperature scaling never changes the predicted class.
    rows = _check_chart(chart)
    assert _top(rows, "raw") == _top(rows, "ts") == next(iter(rows))


def test_classify_a_drawing(client, tmp_path):
    canvas = np.zeros((280, 280, 3), dtype=np.uint8)
    canvas[40:240, 90:190] = 255
    path = tmp_path / "drawing.png"
    Image.fromarray(canvas).save(path)
    value = {"background": handle_file(str(path)), "layers": [], "composite": handle_file(str(path))}
    verdict, chart, view, note = client.predict(value, api_name="/classify_drawing")
    assert "280 × 280" in note
    rows = _check_chart(chart)
    assert _top(rows, "raw") == _top(rows, "ts")


def test_calibrate_small_run(client, default_model):
    out = client.predict(*SHARED, ["Temperature Scaling", "Neural Clamping (FL)"], "1", "auto", "random", "fast", 100,
                         api_name="/calibrate")
    status, live, table, diagrams, params, delta, files = out
    assert status.startswith("**Done**")
    for method in ("Uncalibrated", "Temperature Scaling", "Neural Clamping (FL)"):
        assert f"| {method} |" in table
    assert live["type"] == "plotly" and 'data-delta="[' in delta and "<canvas" in delta  # δ is drawn in the page
    assert [m["name"] for m in diagrams["methods"]] == ["Uncalibrated", "Temperature Scaling", "Neural Clamping (FL)"]
    results = json.loads(Path(next(f for f in files if f.endswith("results.json"))).read_text())
    nc = results["methods"]["Neural Clamping (FL)"]
    assert results["calibration"]["size"] == 300 and results["test"]["size"] == 1000
    # The server's score is that of f(x + δ)/T, recomputed here from the downloaded δ and T on the same split.
    with safe_open(next(f for f in files if f.endswith("delta.safetensors")), "pt") as saved:
        delta, t = saved.get_tensor("delta"), float(saved.metadata()["temperature"])
    _, test = get_splits(default_model, calibration_size=300, calibration_seed=0, test_size=1000)
    x, y = test.tensors()
    assert t == nc["params"]["temperature"]
    ece = metrics.ece(model_logits(default_model.model, x, delta=delta) / t, y)
    assert nc["metrics"]["15"]["ece"]["mean"] == pytest.approx(ece, abs=1e-4)
    assert f"T = {nc['params']['temperature']:.4f}" in params


def test_gamma_sweep_small(client):
    status, fig, table, files = client.predict(*SHARED, 0, 1, 1, "auto", "random", "fast", 100, api_name="/gamma_sweep")
    assert status.startswith("**Done**") and fig["type"] == "plotly"
    data = json.loads(Path(next(f for f in files if f.endswith(".json"))).read_text())
    assert data["gammas"] == [0.0, 1.0] and f"Chosen γ = {data['chosen_gamma']:g}" in table


def test_init_study_small(client):
    status, fig, table, files = client.predict(*SHARED, 2, "1", "auto", "fast", 100, api_name="/init_study")
    assert status.startswith("**Done**") and fig["type"] == "plotly"
    assert "| Random δ₀ |" in table and "| Data-driven δ₀ (Theorem 1) |" in table
    assert any(f.endswith(".png") for f in files)


def test_bad_input_gets_clear_messages_and_the_server_keeps_serving(client, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("this is not a picture")
    huge = tmp_path / "huge.png"
    Image.new("1", (10_000, 10_000)).save(huge)
    colour = tmp_path / "colour.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 48, 3), dtype=np.uint8)).save(colour)

    with pytest.raises(AppError, match="not an image"):
        client.predict(handle_file(str(text)), api_name="/classify")
    with pytest.raises(AppError, match="too large|megapixels"):
        client.predict(handle_file(str(huge)), api_name="/classify")
    # A colour picture for the grey default model is converted, and says so.
    *_, note = client.predict(handle_file(str(colour)), api_name="/classify")
    assert "converted to grey" in note
    # A value outside a menu is refused in the app's words, not the framework's.
    with pytest.raises(AppError, match=r"^Model must be one of: .*fmnist-resnet.*; got 'no-such-model'\.$"):
        client.predict("no-such-model", *SHARED[1:], ["Temperature Scaling"], "1", "auto", "random", "fast", 100,
                       api_name="/calibrate")
    with pytest.raises(AppError, match=r"^Fitter must be one of: fast, paper, toolkit; got 'x+'…\.$"):
        client.predict(*SHARED, ["Temperature Scaling"], "1", "auto", "random", "x" * 500, 100, api_name="/calibrate")
    with pytest.raises(AppError, match="Unknown model 'no-such-model'"):
        client.predict(DEFAULT_MODEL, "no-such-model", *SHARED[2:], ["Temperature Scaling"], "1", "auto", "random",
                       "fast", 100, api_name="/calibrate")
    with pytest.raises(AppError, match="needs the network|not in the Hugging Face cache"):
        client.predict(DEFAULT_MODEL, "someone/not-a-cached-model", *SHARED[2:], ["Temperature Scaling"], "1", "auto",
                       "random", "fast", 100, api_name="/calibrate")
    with pytest.raises(AppError, match="γ"):
        client.predict(*SHARED, ["Neural Clamping (FL)"], "-1", "auto", "random", "fast", 100, api_name="/calibrate")
    with pytest.raises(AppError, match="γ must be ≥ 0"):
        client.predict(*SHARED, -1, 1, 0.5, "auto", "random", "fast", 100, api_name="/gamma_sweep")
    # Uploads over the cap (25 MB) are refused by the server before any handler runs.
    big = tmp_path / "big.png"
    big.write_bytes(b"\x89PNG" + os.urandom(26 * 1024 * 1024))
    with pytest.raises(Exception, match="(?i)maximum|too large|413"):
        client.predict(handle_file(str(big)), api_name="/classify")
    # Still serving: a light and a heavy endpoint both answer.
    plot, table, _ = client.predict(1.0, 15, api_name="/explore_temperature")
    assert "| T = 1.00 (slider) |" in table
    assert _check_chart(client.predict(handle_file(example_images()[1]), api_name="/classify")[1])
