"""What the app's handlers say and offer, run here without a browser: a typed dataset refused at once
in one sentence naming what this server takes, the time left that counts down and then says "Finished",
and the downloads the study tabs promise (JSON and PNG) from their first screen."""
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from nctv.data import DATASETS
from nctv.ui import calibrate as cal_tab
from nctv.ui import gamma as gamma_tab
from nctv.ui import initialisation as init_tab
from nctv.ui import limits
from nctv.ui.common import DONE, ProgressLine, Worker, stream_progress
from nctv.ui.limits import DEFAULT_DATASET_CHOICE
from nctv.zoo import DEFAULT_MODEL

#: The names in the dataset menu, read from the library's registry (not from the app).
LISTED = [k for k in DATASETS if "<" not in k]


@pytest.fixture
def closed_server(monkeypatch):
    """A server as shipped: no folders, no Hub datasets."""
    monkeypatch.delenv("NCTV_DATA_ROOTS", raising=False)
    monkeypatch.delenv("NCTV_HUB_DATASETS", raising=False)


@pytest.mark.parametrize("typed", ["mnist", "svhn", "Fashion-MNIST", "imagenet-21k"])
def test_a_dataset_this_server_does_not_take_is_refused_before_any_work(closed_server, typed):
    run = cal_tab.calibrate(DEFAULT_MODEL, "", typed, 20, 20, 0, 5, ["Temperature Scaling"], "1", "default",
                            "random", "fast", 100)
    status = next(run)[0]  # the first thing the handler says: no model loaded, nothing computed
    sentence = status.removeprefix("**Error** — ").split("\n\n")[0]
    assert sentence == (f"This server accepts the {DEFAULT_DATASET_CHOICE}, {', '.join(LISTED[:-1])} or {LISTED[-1]} "
                        f"as the dataset, not {typed!r}.")
    assert sentence.count(".") == 1 + sum(name.count(".") for name in LISTED) + typed.count(".")  # one sentence
    assert "<" not in sentence and "folder:" not in sentence.split(", not ")[0]  # no placeholder, no folders
    assert limits.dataset_refusal(typed) == f"**Not accepted** — {sentence}"
    with pytest.raises(Exception, match="This server accepts"):
        next(run)


def test_the_refusal_names_what_the_operator_allows(monkeypatch, tmp_path):
    monkeypatch.setenv("NCTV_DATA_ROOTS", str(tmp_path))
    monkeypatch.setenv("NCTV_HUB_DATASETS", "1")
    monkeypatch.setattr(limits, "hub_datasets_available", lambda: True)
    sentence = limits.unaccepted("svhn")
    assert f"folder:/path inside {tmp_path}" in sentence and "hf-dataset:org/name@split" in sentence
    (tmp_path / "pets").mkdir()
    assert limits.resolve_dataset(f"folder:{tmp_path / 'pets'}") == f"folder:{tmp_path / 'pets'}"


def test_a_listed_dataset_is_used_as_typed(closed_server):
    for name in LISTED:
        assert limits.resolve_dataset(f" {name} ") == name and limits.dataset_refusal(name) == ""
    assert limits.resolve_dataset(DEFAULT_DATASET_CHOICE) is None and limits.dataset_refusal(None) == ""


def test_the_time_left_only_counts_down_while_stuck():
    now = [0.0]
    line = ProgressLine(clock=lambda: now[0])
    line.report("Neural Clamping: pass 1", 3, 0.0)
    now[0] = 20.0
    line.report("Neural Clamping: pass 1.5", 3, 0.2)  # a fifth in 20 s: 80 s left
    assert line.text().endswith("about 1 min 20 s left")
    told = []
    for t in range(21, 100, 3):  # stuck at pass 1.5: the rate falls, the time told must not grow
        now[0] = float(t)
        told.append(line.pace.update(3, 0.2))
    assert told == sorted(told, reverse=True) and told[0] == pytest.approx(79.0)
    assert told[-1] == pytest.approx(1.0)
    now[0] = 101.0  # the 80 s told ran out at t = 100
    assert line.text().endswith("longer than estimated: running for 1 min 41 s")
    now[0] = 120.0
    line.report("Neural Clamping: pass 3", 3, 0.8)  # moving again: a fresh estimate from the rate
    assert line.text().endswith(f"about {30} s left")
    now[0] = 121.0
    line.report("done in 121.0 s", DONE, 1.0)
    assert line.text() == "**Finished** in 121.0 s · drawing the result…"


def test_a_study_says_finished_once_its_work_ends():
    def work(report):
        for i in range(1, 5):
            report(("progress", i / 4, f"γ = {i}"))
        return "the result"

    run = stream_progress(Worker(work), lambda *a, **k: None, 4)
    statuses = []
    try:
        while True:
            statuses.append(next(run)[0])
    except StopIteration as end:
        assert end.value == "the result"
    said = [s for s in statuses if isinstance(s, str)]
    assert said[-1].startswith("**Finished**") and all(s.startswith("**Running**") for s in said[:-1])


@pytest.mark.parametrize("tab, name", [(gamma_tab, "gamma_sweep"), (init_tab, "init_study")])
def test_the_study_tabs_offer_json_and_figures_for_slides_from_the_first_screen(tab, name):
    status, figure, table, files = tab.shipped_view()
    assert "pre-computed" in status and [Path(f).name for f in files] == [
        f"{name}.json", f"{name}.png", f"{name}.svg", f"{name}.pdf", "slides.tex"]
    data = json.loads(Path(files[0]).read_text(encoding="utf-8"))
    assert data["seconds"] > 0
    with Image.open(files[1]) as png:
        assert png.format == "PNG" and min(png.size) >= 200
        pixels = np.asarray(png.convert("L"))
    assert pixels.std() > 10  # a drawn figure, not a blank page
