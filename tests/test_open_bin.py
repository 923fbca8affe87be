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
from nctv.ui import learn, state


@pytest.fixture(scope="module")
def shipped():
    pre = state.load_precomputed()
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
    images = state.get_splits(state.load_precomputed().split)[1].arrays()[0]
    for row, item in zip(rows, got["items"], strict=True):
        p1, pt = softmax(z[row:row + 1])[0], softmax(z[row:row + 1] / 1.7)[0]
        assert item["row"] == row
        assert item["label"] == FASHION_MNIST_CLASSES[y[row]]
        assert item["prediction"] == FASHION_MNIST_CLASSES[p1.argmax()]
        assert item["right"] == (p1.argmax() == y[row])
        assert item["confidence_1"] == pytest.approx(p1.max(), abs=1e-12)
        assert item["confidence_t"] == pytest.approx(pt.max(), abs=1e-12)
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


def test_a_folder_of_colour_pictures_gives_colour_thumbnails(tmp_path, monkeypatch):
    """A visitor's run on an image folder: the thumbnails are that folder's own (colour, large) pictures,
    shrunk; labels and predictions named by the folder's classes."""
    from nctv.data import get_splits, load_pools
    from nctv.zoo import DEFAULT_MODEL

    images, labels = load_pools("fashion-mnist").test
    root = tmp_path / "data" / "fmnist"
    for cls in (1, 8):
        (root / FASHION_MNIST_CLASSES[cls]).mkdir(parents=True)
        for i in np.flatnonzero(labels == cls)[:30]:
            # Red pictures of 120 × 120 pixels.
            grey = np.asarray(images.pil(int(i)).convert("L").resize((120, 120)))
            rgb = np.stack([grey, grey // 3, grey // 3], axis=-1)
            Image.fromarray(rgb, "RGB").save(root / FASHION_MNIST_CLASSES[cls] / f"{i}.png")
    monkeypatch.setenv("NCTV_DATA_ROOTS", str(tmp_path / "data"))
    spec = state.SplitSpec(DEFAULT_MODEL, f"folder:{root}", 10, 0, 20)
    cal = state.Calibration(split=spec, model=DEFAULT_MODEL, ts_temperature=1.0, nc_temperature=None, delta=None,
                            nc_method=None, source="a test run")
    test = get_splits(state.get_model(DEFAULT_MODEL), dataset=f"folder:{root}", calibration_size=10, test_size=20)[1]
    got = learn.open_bin(cal, gr.EventData(None, {"rows": [0, 19], "temperature": 2.0, "request": 1}))["bin"]
    for row, item in zip([0, 19], got["items"], strict=True):
        thumb = pixels(item["src"])
        assert thumb.shape == (learn.THUMB_PX, learn.THUMB_PX, 3) and not item["small"]
        assert thumb[..., 0].mean() > 2 * thumb[..., 1].mean()  # still red
        assert item["label"] == FASHION_MNIST_CLASSES[int(test.labels[row])]
        assert item["prediction"] in FASHION_MNIST_CLASSES
    # Row 20 is past the end of this 20-picture test split.
    assert "0 to 19" in learn.open_bin(cal, gr.EventData(None, {"rows": [20], "temperature": 1}))["bin"]["message"]
