"""Opening a group of the Learn tab's diagram, server side: the pictures of the rows the page asks
for, with labels, predictions and confidences computed here from the shipped logits, and refusal of
any request that is not a short list of row numbers of the test split."""
import base64
import io

import gradio as gr
import numpy as np
import pytest
from PIL import Image

from nctv.data import FASHION_MNIST_CLASSES
from nctv.settings import NCOptions
from nctv.ui import caches, learn, session
from nctv.ui.shipped import load_precomputed


@pytest.fixture(scope="module")
def shipped():
    pre = load_precomputed()
    return pre.result.methods["Uncalibrated"].test_logits.double().numpy(), pre.result.test_labels.numpy()


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def pixels(src: str) -> np.ndarray:
    assert src.startswith("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))))


def answer(data):
    return learn.open_bin(None, gr.EventData(None, data))["bin"]


def test_pictures_of_the_asked_rows(shipped):
    z, y = shipped
    rows = [9_999, 0, 17, 4_242]
    got = answer({"rows": rows, "temperature": 1.7, "request": 5})
    assert got["request"] == 5 and "message" not in got
    images = caches.get_splits(load_precomputed().split)[1].arrays()[0]
    for row, item in zip(rows, got["items"], strict=True):
        p1, pt = softmax(z[row:row + 1])[0], softmax(z[row:row + 1] / 1.7)[0]
        assert item["row"] == row
        assert item["label"] == FASHION_MNIST_CLASSES[y[row]]
        assert item["prediction"] == FASHION_MNIST_CLASSES[p1.argmax()]
        assert item["prediction_after"] == item["prediction"]  # dividing by T keeps the predicted class
        assert item["right"] == (p1.argmax() == y[row])
        assert item["confidence_before"] == pytest.approx(p1.max(), abs=1e-12)
        assert item["confidence_after"] == pytest.approx(pt.max(), abs=1e-12)
        # The 28 × 28 picture itself, lossless, marked for enlarging pixel by pixel.
        assert item["small"] and np.array_equal(pixels(item["src"]), images[row])


def test_a_sampled_page_names_the_rows_of_the_split(shipped, monkeypatch):
    z, _ = shipped
    monkeypatch.setattr(learn, "PAGE_MAX_VALUES", 25_000)
    data = learn.page_data(None)
    rows = np.frombuffer(base64.b64decode(data["rows"]), dtype="<i4")
    sample = np.frombuffer(base64.b64decode(data["logits"]), dtype="<f4").reshape(data["n"], data["k"])
    assert len(rows) == data["n"] == 2_500 and np.all(np.diff(rows) > 0)
    assert np.array_equal(sample, z[rows].astype("<f4"))


def test_the_whole_split_goes_without_row_numbers():
    assert "rows" not in learn.page_data(None)


@pytest.mark.parametrize("rows", [
    [-1], [10_000], [10 ** 18], [1.5], [2.0], ["3"], [True], [None], [[1]], list(range(learn.BIN_MAX_ROWS + 1)),
    "0,1,2", 7, None, {"0": 1},
], ids=["negative", "one-past-end", "huge", "fraction", "float", "text", "bool", "null", "nested", "too-many",
        "string", "number", "missing", "object"])
def test_bad_rows_are_refused_in_words(rows):
    got = answer({"rows": rows, "temperature": 1.0, "request": 2})
    assert got["request"] == 2 and "items" not in got
    assert "row" in got["message"].lower() or "pictures" in got["message"].lower()
    assert "Traceback" not in got["message"] and "/" not in got["message"]


def test_bad_temperature_or_event_is_refused_in_words():
    assert "temperature" in answer({"rows": [0], "temperature": "hot"})["message"]
    assert "temperature" in answer({"rows": [0], "temperature": 99})["message"]
    # Not even an object: still an answer, not an error.
    assert "message" in learn.open_bin(None, gr.EventData(None, [1, 2]))["bin"]


def test_the_largest_request_is_answered():
    got = answer({"rows": list(range(learn.BIN_MAX_ROWS)), "temperature": 1.0, "request": 1})
    assert [item["row"] for item in got["items"]] == list(range(learn.BIN_MAX_ROWS))


def colour_folder(tmp_path, monkeypatch, size: int, channel: int):
    """A folder of 30 trousers and 30 bags of Fashion-MNIST's test pool as size × size colour pictures,
    bright in ``channel`` only (0 red, 1 green), allowed to visitors (``NCTV_DATA_ROOTS``)."""
    from nctv.data import load_pools

    images, labels = load_pools("fashion-mnist").test
    root = tmp_path / "data" / "fmnist"
    for cls in (1, 8):
        (root / FASHION_MNIST_CLASSES[cls]).mkdir(parents=True)
        for i in np.flatnonzero(labels == cls)[:30]:
            grey = np.asarray(images.pil(int(i)).convert("L").resize((size, size)))
            rgb = np.stack([grey if c == channel else grey // 3 for c in range(3)], axis=-1)
            Image.fromarray(rgb, "RGB").save(root / FASHION_MNIST_CLASSES[cls] / f"{i}.png")
    monkeypatch.setenv("NCTV_DATA_ROOTS", str(tmp_path / "data"))
    return root


def test_a_folder_of_colour_pictures_gives_colour_thumbnails(tmp_path, monkeypatch):
    """A visitor's run on an image folder: the thumbnails are that folder's own (colour, large) pictures,
    shrunk; labels and predictions named by the folder's classes."""
    from nctv.data import get_splits
    from nctv.zoo import DEFAULT_MODEL

    root = colour_folder(tmp_path, monkeypatch, 120, 0)  # red pictures of 120 × 120 pixels
    spec = session.SplitSpec(DEFAULT_MODEL, f"folder:{root}", 10, 0, 20)
    cal = session.Calibration(split=spec, model=DEFAULT_MODEL, ts_temperature=1.0, nc_temperature=None, delta=None,
                            nc_method=None, source="a test run")
    test = get_splits(caches.get_model(DEFAULT_MODEL), dataset=f"folder:{root}", calibration_size=10, test_size=20)[1]
    got = learn.open_bin(cal, gr.EventData(None, {"rows": [0, 19], "temperature": 2.0, "request": 1}))["bin"]
    for row, item in zip([0, 19], got["items"], strict=True):
        thumb = pixels(item["src"])
        assert thumb.shape == (learn.THUMB_PX, learn.THUMB_PX, 3) and not item["small"]
        assert thumb[..., 0].mean() > 2 * thumb[..., 1].mean()  # still red
        assert item["label"] == FASHION_MNIST_CLASSES[int(test.labels[row])]
        assert item["prediction"] in FASHION_MNIST_CLASSES
    # Row 20 is past the end of this 20-picture test split.
    assert "0 to 19" in learn.open_bin(cal, gr.EventData(None, {"rows": [20], "temperature": 1}))["bin"]["message"]


# --------------------------------------------------------------------------- the Calibrate tab's groups


def calibrate_answer(shown, data):
    from nctv.ui import calibrate

    return calibrate.open_group(shown, gr.EventData(None, data))["bin"]


def top_labels(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    p = softmax(z.astype(np.float64))
    return p.max(axis=1), p.argmax(axis=1)


def test_a_shipped_group_of_a_method_lists_its_pictures_before_and_after():
    """Group 12 of 15 of Neural Clamping's diagram: the rows whose calibrated confidence lies in
    (12/15, 13/15], computed here with numpy from the shipped logits; wrong ones first, then the surest."""
    pre = load_precomputed()
    method, y = "Neural Clamping (FL)", pre.result.test_labels.numpy()
    conf, pred = top_labels(pre.result.methods[method].test_logits.numpy())
    conf0, pred0 = top_labels(pre.result.methods["Uncalibrated"].test_logits.numpy())
    members = np.flatnonzero((conf > 12 / 15) & (conf <= 13 / 15))
    got = calibrate_answer(None, {"method": method, "bin": 12, "request": 3})
    assert got["request"] == 3 and got["count"] == len(members)
    assert got["right"] == int((pred[members] == y[members]).sum())
    rows = [item["row"] for item in got["items"]]
    assert len(rows) == min(24, len(members)) and set(rows) <= set(members.tolist())
    wrong = [not item["right"] for item in got["items"]]
    assert wrong == sorted(wrong, reverse=True)  # every wrong one before the first right one
    for item in got["items"]:
        r = item["row"]
        assert 12 / 15 < item["confidence_after"] <= 13 / 15
        assert item["confidence_after"] == pytest.approx(conf[r], abs=1e-6)
        assert item["confidence_before"] == pytest.approx(conf0[r], abs=1e-6)
        assert item["label"] == FASHION_MNIST_CLASSES[y[r]]
        assert item["prediction"] == FASHION_MNIST_CLASSES[pred0[r]]
        assert item["prediction_after"] == FASHION_MNIST_CLASSES[pred[r]]
        assert item["right"] == (pred[r] == y[r])
    first_right = [c["confidence_after"] for c in got["items"] if c["right"]]
    assert first_right == sorted(first_right, reverse=True)


@pytest.mark.parametrize("data", [
    {"method": "No such method", "bin": 3}, {"method": None, "bin": 3}, {"method": "Temperature Scaling", "bin": 15},
    {"method": "Temperature Scaling", "bin": -1}, {"method": "Temperature Scaling", "bin": 2.0},
    {"method": "Temperature Scaling", "bin": True}, {"method": "Temperature Scaling"},
], ids=["unknown", "missing", "past-end", "negative", "float", "bool", "no-bin"])
def test_a_group_not_shown_is_refused_in_words(data):
    got = calibrate_answer(None, {**data, "request": 4})
    assert got["request"] == 4 and "items" not in got
    assert ("method" in got["message"] or "Groups are numbered 0 to 14" in got["message"])
    assert "Traceback" not in got["message"] and "/" not in got["message"]


def test_a_run_on_a_folder_opens_groups_of_its_own_pictures(tmp_path, monkeypatch):
    """A visitor's run on an image folder: the group's thumbnails are that folder's pictures, and the
    calibrated confidences those of the run's own temperature scaling."""
    from nctv.ui import calibrate
    from nctv.zoo import DEFAULT_MODEL

    root = colour_folder(tmp_path, monkeypatch, 60, 1)  # green pictures of 60 × 60 pixels
    spec = session.SplitSpec(DEFAULT_MODEL, f"folder:{root}", 20, 0, 20)
    result, cal = calibrate.run_calibration(spec, ["Temperature Scaling"], 5, NCOptions())
    shown = calibrate.shown_run(result, cal.split, 5)
    t = result.methods["Temperature Scaling"].params["temperature"]
    conf, pred = top_labels(result.methods["Uncalibrated"].test_logits.double().numpy() / t)
    test = caches.get_splits(spec)[1]
    group = int(np.clip(np.ceil(conf.max() * 5) - 1, 0, 4))  # the group of the surest picture
    members = np.flatnonzero(np.clip(np.searchsorted(np.linspace(0, 1, 6), conf, side="left") - 1, 0, 4) == group)
    got = calibrate_answer(shown, {"method": "Temperature Scaling", "bin": group, "request": 1})
    assert got["count"] == len(members) > 0
    for item in got["items"]:
        thumb = pixels(item["src"])
        assert thumb.shape == (60, 60, 3) and thumb[..., 1].mean() > 2 * thumb[..., 0].mean()  # still green
        assert item["label"] == FASHION_MNIST_CLASSES[int(test.labels[item["row"]])]
        assert item["confidence_after"] == pytest.approx(conf[item["row"]], abs=1e-6)
