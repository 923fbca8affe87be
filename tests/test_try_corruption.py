"""The Try tab's corruption: the visitor's picture is corrupted (``nctv.corruptions.corrupt_image``)
before the model's preprocessing, and the chart shows each calibrated confidence of the corrupted
picture with the clean picture's marked. The expected numbers are computed here from the model
itself; bad menu or severity values are refused in words, by the handler and through the API of the
launched app."""
import html
import re

import gradio as gr
import numpy as np
import pytest
import torch
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image

from nctv.corruptions import CORRUPTIONS, corrupt_image
from nctv.ui import try_image
from nctv.ui.shipped import load_precomputed

EXAMPLE = try_image.example_images()[3]
#: Every bar of a chart: its method, the corrupted picture's probability and the clean one's.
BAR = re.compile(r'data-method="(\w+)" data-confidence="([^"]+)" data-clean="([^"]+)"')
ROW = re.compile(r'<div class="nctv-class" data-class="([^"]*)">(.*?)(?=<div class="nctv-class"|</div></div></div>$)')


def softmax(logits: torch.Tensor) -> np.ndarray:
    return torch.softmax(logits.double(), dim=-1)[0].numpy()


def expected(model, picture: Image.Image) -> dict[str, np.ndarray]:
    """Uncalibrated, TS and NC probabilities of ``picture`` from the model's own forward pass and the
    shipped calibration's T and δ: softmax(f(x)), softmax(f(x)/T), softmax(f(x + δ)/T_NC)."""
    cal = load_precomputed().calibration
    x = model.preprocess(picture)[None]
    with torch.no_grad():
        z, z_delta = model.model(x), model.model(x + cal.delta)
    return {"raw": softmax(z), "ts": softmax(z / cal.ts_temperature), "nc": softmax(z_delta / cal.nc_temperature)}


def bars(page: str) -> dict[str, dict[str, tuple[float, float]]]:
    """{class: {method: (corrupted, clean)}} from the chart's data attributes."""
    return {html.unescape(name): {m: (float(p), float(c)) for m, p, c in BAR.findall(row)}
            for name, row in ROW.findall(page)}


def test_severity_0_is_the_clean_result_exactly(default_model):
    clean = try_image.classify(EXAMPLE, None)
    for name in CORRUPTIONS:
        assert try_image.classify(EXAMPLE, None, name, 0) == clean, name
    assert "nctv-shifted" not in clean[1] and "data-clean" not in clean[1] and "Corruption:" not in clean[3]


@pytest.mark.parametrize("name,severity", [("gaussian-noise", 3), ("contrast", 2), ("defocus-blur", 5), ("jpeg", 4)])
def test_corrupted_confidences_are_the_models_own_on_corrupt_images_output(default_model, name, severity):
    picture = Image.open(EXAMPLE).convert("L")
    corrupted = corrupt_image(picture, name, severity)
    assert not np.array_equal(np.asarray(corrupted), np.asarray(picture))
    now, before = expected(default_model, corrupted), expected(default_model, picture)
    verdict, page, view, note = try_image.classify(EXAMPLE, None, name, severity)
    shown = bars(page)
    assert len(shown) >= 5
    for cls, methods in shown.items():
        i = default_model.class_names.index(cls)
        assert set(methods) == {"raw", "ts", "nc"}
        for m, (p, clean) in methods.items():
            assert p == pytest.approx(float(now[m][i]), abs=1e-6), (cls, m)
            assert clean == pytest.approx(float(before[m][i]), abs=1e-6), (cls, m)
    # The sentence: the clean picture's answer, each method's confidence in it before and after.
    first = int(np.argmax(before["raw"]))
    moved = ", ".join(f"{words} {try_image.percent(float(before[m][first]))} → {try_image.percent(float(now[m][first]))}"
                      for m, words in (("raw", "uncalibrated"), ("ts", "temperature scaling"), ("nc", "Neural Clamping")))
    assert html.escape(moved) in page
    assert f"<b>{default_model.class_names[first]}</b>" in page
    # The picture shown is the corrupted one; the details name the corruption and its parameter.
    figure = re.search(r'<figure class="nctv-shifted" data-corruption="([^"]+)" data-severity="(\d)">', page)
    assert figure.groups() == (name, str(severity))
    value = CORRUPTIONS[name].value(severity, 28)
    assert f"at severity {severity} ({CORRUPTIONS[name].parameter} {value})" in note
    # The out-of-distribution verdict judges the picture the model got.
    assert re.search(r'data-flagged="(true|false)"', verdict)


def test_the_out_of_distribution_check_judges_the_corrupted_picture(default_model):
    """The shipped example passes the check as it is; faded to a tenth of its contrast it is flagged, and its
    answer is marked so (not greyed out: it keeps its contrast)."""
    verdict, page, *_ = try_image.classify(EXAMPLE, None, "contrast", 0)
    assert 'data-flagged="false"' in verdict and '<div class="nctv-chart" data-flagged="false">' in page
    verdict, page, *_ = try_image.classify(EXAMPLE, None, "contrast", 5)
    assert 'data-flagged="true"' in verdict and '<div class="nctv-chart" data-flagged="true">' in page


def test_a_large_picture_is_shrunk_before_it_is_corrupted(default_model, tmp_path):
    big = tmp_path / "big.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (1500, 2000), dtype=np.uint8)).save(big)
    picture, note = try_image.corrupted(Image.open(big), "gaussian-noise", 1)
    assert picture.size == (1182, 886) and picture.width * picture.height <= try_image.MAX_CORRUPTED_PIXELS
    assert "shrunk to 1182 × 886 pixels" in note
    *_, details = try_image.classify(str(big), None, "gaussian-noise", 1)
    assert "shrunk to 1182 × 886 pixels" in details and "2000 × 1500 pixels" in details


@pytest.mark.parametrize("corruption,severity,words", [
    ("fog", 1, "Unknown corruption 'fog'; use one of: gaussian-noise"),
    ("contrast", 2.5, "The corruption's severity must be a whole number; got 2.5."),
    ("contrast", 6, "The corruption's severity must be at least 0 and at most 5; got 6."),
    ("contrast", -1, "The corruption's severity must be at least 0 and at most 5; got -1."),
    ("contrast", True, "The corruption's severity must be a whole number from 0 to 5; got True."),
    ("contrast", "three", "The corruption's severity must be a whole number; got 'three'."),
    ("x" * 5000, 1, "Unknown corruption 'xxxx"),
])
def test_bad_values_are_refused_in_words(corruption, severity, words):
    for picture in (EXAMPLE, None):
        with pytest.raises(gr.Error) as refused:
            try_image.classify(picture, None, corruption, severity)
        assert refused.value.message.startswith(words), refused.value.message
        assert len(refused.value.message) < 300
    with pytest.raises(gr.Error, match="whole number"):
        try_image.classify_drawing(None, None, "contrast", 1.5)


def test_the_api_takes_a_corruption_and_refuses_a_bad_one_in_words(server):
    client = Client(server, verbose=False)
    # Older calls (a picture only) still work: the corruption defaults to none.
    _, plain, _, _ = client.predict(handle_file(EXAMPLE), api_name="/classify")
    assert "nctv-shifted" not in plain
    _, page, _, note = client.predict(handle_file(EXAMPLE), "shot-noise", 4, api_name="/classify")
    assert 'data-corruption="shot-noise" data-severity="4"' in page and "shot noise at severity 4" in note
    for corruption, severity, words in (("fog", 1, "Corrupt the picture must be one of: gaussian-noise"),
                                        ("contrast", 9, "Severity must be a whole number from 0 to 5; got 9."),
                                        ("contrast", 2.5, "Severity must be a whole number from 0 to 5; got 2.5."),
                                        ("contrast", "x", "Severity must be a whole number from 0 to 5; got 'x'")):
        with pytest.raises(AppError) as refused:
            client.predict(handle_file(EXAMPLE), corruption, severity, api_name="/classify")
        assert str(refused.value).startswith(words), str(refused.value)
        assert "Traceback" not in str(refused.value)
    # The server still answers.
    assert client.predict(handle_file(EXAMPLE), api_name="/classify")[1] == plain
