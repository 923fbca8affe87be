"""The app's handlers called directly (no server, no browser) on the embedded default model.

Expected values are computed independently: logits straight from the model, probabilities by
softmax, metrics by nctv.metrics on those logits, temperature scaling refitted on the same logits.
Splits are small (300 calibration and 1,000 test images) so that every fit takes seconds.
"""
import base64
import csv
import dataclasses
import html
import io
import json
import os
import re
import time
import zipfile
import subprocess
import sys
from pathlib import Path

import gradio as gr
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from nctv import metrics
from nctv.calibration import METHODS
from nctv.data import FASHION_MNIST_CLASSES as FMNIST_CLASSES
from nctv.data import get_splits as data_splits
from nctv.data import assets_dir
from nctv.data import load_pools as data_load_pools
from nctv.cache import model_fingerprint
from nctv.inference import model_logits
from nctv.hub import max_model_bytes
from nctv.memory import DeviceOutOfMemoryError
from nctv.settings import NCOptions
from nctv.ui import calibrate as cal_tab
from nctv.ui import gamma as gamma_tab
from nctv.ui import initialisation as init_tab
from nctv.ui import caches, learn, limits, session, try_image
from nctv.ui.shipped import PRECOMPUTED_LABEL, load_precomputed, precomputed_dir
from nctv.ui import images as ui_images
from nctv.ui.common import (SAME_TASK, SERVER_PATH, ProgressLine, Worker, duration, parse_whole, redact,
                            user_errors)
from nctv.images import MAX_PIXELS, ImageError, decoded_bytes, match_channels, to_pil
from nctv.ui.images import CheckedImage, CheckedSketchpad
from nctv.training import train_classifier
from nctv.zoo import DEFAULT_MODEL

SMALL = session.SplitSpec(DEFAULT_MODEL, None, 300, 0, 1000)
METHODS_RUN = ["Uncalibrated", "Temperature Scaling", "Neural Clamping (FL)"]
SHARED = (DEFAULT_MODEL, "", limits.DEFAULT_DATASET_CHOICE, 300, 1000, 0, 15)


@pytest.fixture(scope="module", autouse=True)
def _logit_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("NCTV_CACHE_DIR", str(tmp_path_factory.mktemp("nctv-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def splits(default_model):
    cal, test = data_splits(default_model, calibration_size=300, calibration_seed=0, test_size=1000)
    return cal.tensors(), test.tensors()


@pytest.fixture(scope="module")
def logits(default_model, splits):
    """The model's own logits on both splits, computed here independently of the app."""
    (x_cal, _), (x_test, _) = splits
    return model_logits(default_model.model, x_cal), model_logits(default_model.model, x_test)


@pytest.fixture(scope="module")
def run():
    items = []
    result, calibration = cal_tab.run_calibration(SMALL, METHODS_RUN, 15, NCOptions(), items.append)
    return result, calibration, items


def test_run_scores_every_method_on_independently_computed_logits(run, default_model, splits, logits):
    result, calibration, _ = run
    (_, y_cal), (x_test, y_test) = splits
    z_cal, z_test = logits
    assert list(result.methods) == METHODS_RUN
    assert torch.equal(result.test_labels, y_test)
    # Uncalibrated: exactly the model's logits.
    assert torch.allclose(result.methods["Uncalibrated"].test_logits, z_test, atol=1e-5)
    ece = {m: r.metrics[15]["ece"].mean for m, r in result.methods.items()}
    assert ece["Uncalibrated"] == pytest.approx(metrics.ece(z_test, y_test), abs=1e-6)
    # Temperature scaling refitted here on the same calibration logits.
    t = METHODS["Temperature Scaling"].factory().fit(z_cal, y_cal).temperature_
    assert calibration.ts_temperature == pytest.approx(t, rel=1e-4)
    assert ece["Temperature Scaling"] == pytest.approx(metrics.ece(z_test / t, y_test), abs=1e-5)
    # Neural Clamping: the reported scores are those of f(x + δ)/T with the δ and T it reports.
    nc = result.methods["Neural Clamping (FL)"]
    assert calibration.nc_method == "Neural Clamping (FL)" and torch.equal(calibration.delta, nc.delta)
    assert nc.delta.shape == x_test.shape[1:]
    z_nc = model_logits(default_model.model, x_test, delta=nc.delta) / calibration.nc_temperature
    assert torch.allclose(nc.test_logits, z_nc, atol=1e-4)
    assert nc.metrics[15]["ece"].mean == pytest.approx(metrics.ece(z_nc, y_test), abs=1e-4)
    # The default's "auto" λ: 0.1 × the mean focal loss (γ = 1) of the model's own calibration logits at
    # the anchored T, which the fit kept.
    p = torch.softmax(z_cal.double() / calibration.nc_temperature, 1).gather(1, y_cal[:, None]).squeeze(1)
    assert nc.params["gamma"] == 1.0
    assert nc.params["weight_decay"] == pytest.approx(0.1 * float((-(1 - p) * torch.log(p)).mean()), rel=1e-6)
    assert calibration.metrics["Neural Clamping (FL)"]["ece"] == nc.metrics[15]["ece"].mean
    assert result.model["fingerprint"] == model_fingerprint(default_model.model)


def test_run_reports_progress_and_live_loss_and_temperature(run):
    result, calibration, items = run
    fractions = [i[1] for i in items if i[0] == "progress"]
    assert fractions[0] == 0.0 and fractions[-1] == 1.0 and fractions == sorted(fractions)  # never goes back
    live = [i for i in items if i[0] == "nc"]
    assert live and {i[1] for i in live} == {"Neural Clamping (FL)"}
    assert all(np.isfinite(i[2]["loss"]) for i in live)
    # The live pass count only grows and ends at the passes the fit reports.
    passes = [i[2]["passes"] for i in live]
    assert passes == sorted(passes) and passes[-1] == result.methods["Neural Clamping (FL)"].params["n_passes"]
    # The last live temperature is the learned one (the fast fitter reports every evaluation).
    assert any(i[2]["temperature"] == pytest.approx(calibration.nc_temperature, rel=1e-3) for i in live[-5:])


def test_live_plot_counts_the_passes_the_library_reports():
    """The live plot's x values are the passes of the real fit's own step reports, through the
    same callback the Calibrate tab gives the library."""
    items = []
    cal_tab.run_calibration(session.SplitSpec(DEFAULT_MODEL, None, 100, 0, 100), ["Neural Clamping (FL)"], 5,
                            NCOptions(), items.append)
    live = cal_tab.LiveTrace()
    steps = [i for i in items if i[0] == "nc"]
    for _, method, info in steps:
        live.add(method, info)
    reported = [float(info["passes"]) for _, _, info in steps]
    assert len(reported) > 3 and reported[-1] > reported[0]
    assert live.series["Neural Clamping (FL)"]["x"] == reported
    fig = live.figure()
    assert list(fig.data[0].x) == reported and fig.layout.xaxis.title.text == "passes over the calibration split"


def test_live_plot_gives_each_method_one_colour_in_both_panels():
    live = cal_tab.LiveTrace()
    for step in range(3):
        for method in ("Neural Clamping (FL)", "Neural Clamping (CE)"):
            live.add(method, {"loss": 1.0 / (step + 1), "temperature": 1.0 + step, "passes": step})
    fig = live.figure()
    colours = {}
    for trace in fig.data:
        assert trace.line.color == trace.marker.color
        colours.setdefault(trace.name, set()).add(trace.line.color)
    assert all(len(c) == 1 for c in colours.values())  # the legend's colour is the line's in both panels
    assert len({next(iter(c)) for c in colours.values()}) == 2  # and the methods differ
    assert [t.name for t in fig.data if t.showlegend] == ["Neural Clamping (FL)", "Neural Clamping (CE)"]


def test_app_run_is_the_library_run(run, default_model):
    """The Calibrate tab runs the library's engine: run_experiment with the same split, seed and
    settings gives the same temperatures, δ and scores."""
    from nctv.experiment import run_experiment

    result, _, _ = run
    cal, test = data_splits(default_model, calibration_size=300, calibration_seed=0, test_size=1000)
    lib = run_experiment(default_model, cal, test, METHODS_RUN, seeds=[0], bins=[15], gamma=1.0, progress=False,
                         init="random")
    for name in METHODS_RUN:
        a, b = result.methods[name], lib.methods[name]
        assert a.params.get("temperature", 1.0) == pytest.approx(b.params.get("temperature", 1.0), rel=1e-6)
        assert a.metrics[15]["ece"].mean == pytest.approx(b.metrics[15]["ece"].mean, abs=1e-7)
    assert torch.equal(result.methods["Neural Clamping (FL)"].delta, lib.methods["Neural Clamping (FL)"].delta)


def test_app_offers_the_ablation_rows():
    """Table 4's rows are methods of the Calibrate tab; "NC output only" is f(x)/T* of the same fit."""
    assert {"NC input only", "NC output only", "NC δ frozen at 0"} <= set(cal_tab.method_choices())
    result, _ = cal_tab.run_calibration(SMALL, ["Uncalibrated", "Neural Clamping (FL)", "NC output only"], 15,
                                        NCOptions())
    t = result.methods["Neural Clamping (FL)"].params["temperature"]
    z = result.methods["Uncalibrated"].test_logits / t
    assert torch.allclose(result.methods["NC output only"].test_logits, z, atol=1e-6)


def _row(table: str, method: str) -> list[str]:
    line = next(ln for ln in table.splitlines() if ln.startswith(f"| {method} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_table_marks_best_only_where_the_paired_interval_says_so(run):
    result, calibration, _ = run
    table = cal_tab.table_markdown(result, 15, calibration.source)
    head = next(ln for ln in table.splitlines() if ln.startswith("| Method"))
    header = [c.strip() for c in head.strip("|").split("|")]
    col = header.index("ECE (%) ↓")
    ece = {m: r.metrics[15]["ece"] for m, r in result.methods.items()}
    best = min(ece, key=lambda m: ece[m].mean)
    for method, stats in ece.items():
        cell = _row(table, method)[col]
        # Every figure with its 95 % interval: "value [low, high]" in % with two decimals.
        shown = f"{100 * stats.mean:.2f} [{100 * stats.ci_low:.2f}, {100 * stats.ci_high:.2f}]"
        # A row whose calibration test does not reject says so, its interval reaching 0 (docs/method.md).
        p = result.methods[method].metrics[15]["calibration_p"].mean
        if p >= 0.05:
            assert stats.ci_low == 0
            shown += f", consistent with calibrated (p = {p:.3f})"
        assert cell.strip("*_") == shown
        # Bold for the lowest ECE and for every row whose paired difference to it has an interval
        # holding 0 (the data cannot tell them apart); never for a row the interval separates.
        c = result.comparison(method, best, "ece", 15)
        tied = method == best or (c.low <= 0 <= c.high)
        assert cell.startswith("**") == tied, (method, cell, c)
    assert "±" not in table  # one run per method: no seed spread, only the test split's interval


def test_calibrate_handler_streams_then_returns_everything(tmp_path):
    outs = list(cal_tab.calibrate(*SHARED, ["Temperature Scaling", "Neural Clamping (FL)"], "1", "auto", "random",
                                  "fast", 100))
    assert len(outs) >= 2 and all(len(o) == len(cal_tab.OUTPUTS) for o in outs)
    status, panel, live, table, diagrams, params, delta, files, calibration, shown = outs[-1]
    assert status.startswith("**Done**") and "| Neural Clamping (FL) |" in table and "| Uncalibrated |" in table
    # 300 images for a δ of 784 values: the library's small-split warning reaches the page.
    assert "⚠ Neural Clamping: 300 calibration images for a δ of 784 values" in status
    assert panel["visible"] is True and len(live.data) == 2  # loss and T of one NC fit
    assert delta is not None
    # The diagrams' numbers, one entry per method in the run's order, for the page to draw.
    assert [m["name"] for m in diagrams["methods"]] == ["Uncalibrated", "Temperature Scaling", "Neural Clamping (FL)"]
    assert diagrams["bins"] == 15 and diagrams["n"] == 1000
    assert all(sum(m["counts"]) == 1000 for m in diagrams["methods"])
    assert shown.split == SMALL and set(shown.confidence) == {m["name"] for m in diagrams["methods"]}
    # Running: the status says which step runs and, once it can, the time it still needs.
    *running, finishing = [o[0] for o in outs[:-1] if isinstance(o[0], str)]
    assert running and all(r.startswith("**Running** — ") for r in running)
    # Once the work is done, "Finished" while the tables and figures are made (not "Running — done in …").
    assert re.fullmatch(r"\*\*Finished\*\* in [\d.]+ s · drawing the result…", finishing), finishing
    # A fit this short (about half a second, updates at most every 0.25 s) may end before an estimate
    # is possible: test_time_left_follows_the_rate_of_the_running_task checks the estimate itself.
    assert any(re.search(r"Neural Clamping \(FL\) \(seed 0\): pass [\d.]+, loss [\d.]+, T [\d.]+ · ", r)
               for r in running)
    assert "T = " in params and isinstance(calibration, session.Calibration) and calibration.split == SMALL
    assert Path(files[0]).name == "calibrators.zip"  # the file to reuse first
    names = {Path(f).name for f in files}
    assert {"results.json", "table.csv", "table.md", "slides.tex", "delta.safetensors"} <= names
    assert {f"{f}.{ext}" for f in ("reliability", "smooth_reliability", "delta") for ext in ("png", "svg", "pdf")} <= names
    by_name = {Path(f).name: Path(f) for f in files}
    data = json.loads(by_name["results.json"].read_text())
    assert list(data["methods"]) == ["Uncalibrated", "Temperature Scaling", "Neural Clamping (FL)"]
    rows = list(csv.DictReader(io.StringIO(by_name["table.csv"].read_text())))
    assert [r["method"] for r in rows] == list(data["methods"])
    ece_nc = data["methods"]["Neural Clamping (FL)"]["metrics"]["15"]["ece"]["mean"]
    assert float(rows[2]["ECE (%)"]) == pytest.approx(100 * ece_nc)
    assert Image.open(by_name["reliability.png"]).size[0] > 100


def test_stop_ends_the_worker_at_its_next_report():
    slow = NCOptions(fitter="paper", epochs=1000)
    worker = Worker(lambda report: cal_tab.run_calibration(SMALL, ["Neural Clamping (FL)"], 15, slow, report))
    stream = worker.stream()
    for items in stream:
        if any(i[0] == "nc" for i in items):
            break
    stream.close()  # what Gradio does when Stop is pressed
    worker._thread.join(timeout=120)
    assert not worker._thread.is_alive()
    assert worker.result is None and worker.error is None


def test_stop_ends_a_model_pass_between_chunks():
    """Cancellation reaches the logit pass itself: after Stop no further chunk of the model runs."""
    calls = []

    class Slow(torch.nn.Module):
        def forward(self, x):
            calls.append(len(x))
            time.sleep(0.05)
            return x.flatten(1)[:, :3]

    def work(report):
        report(("started",))
        return model_logits(Slow(), torch.zeros(200, 1, 2, 2), batch_size=2)  # 100 chunks, about 5 s

    worker = Worker(work)
    stream = worker.stream()
    while not next(stream):  # empty lists while the thread starts
        pass
    time.sleep(0.2)  # a few chunks into the pass
    stream.close()
    worker._thread.join(timeout=30)
    assert not worker._thread.is_alive() and worker.result is None and worker.error is None
    assert 0 < len(calls) < 20  # it stopped within a chunk or two of the Stop, far from the 100 chunks


@pytest.mark.parametrize("args, words", [
    (dict(gamma="-1"), "γ"),
    (dict(gamma="1e308"), "from 0 to 10"),
    (dict(weight_decay="1e9"), "from 0 to 1,000,000"),
    (dict(epochs=10**6), "at most 1000"),
    (dict(weight_decay="lots"), "λ"),
    (dict(size=0), "Calibration size"),
    (dict(size=10**6), "holds only"),
    (dict(test_size=2.5), "Test size"),
    (dict(model="no-such-model"), "Unknown model"),
    (dict(hub_id="local-dir:/etc"), "Hugging Face Hub model id"),
    (dict(methods=[]), "at least one"),
    (dict(methods=["Uncalibrated"]), "at least one"),
    (dict(methods=["Platt"]), "Unknown method"),
    (dict(epochs=0), "Epochs"),
    (dict(lr="0"), "learning rate must be 'default'"),
    (dict(lr="100"), "at most 10"),
    (dict(lr="fast"), "learning rate"),
])
def test_calibrate_handler_refuses_bad_settings_in_words(args, words):
    a = dict(model=DEFAULT_MODEL, hub_id="", size=300, test_size=1000, methods=["Temperature Scaling"], gamma="1",
             weight_decay="auto", epochs=100, lr="default")
    a.update(args)
    with pytest.raises(gr.Error, match=re.escape(words)):
        list(cal_tab.calibrate(a["model"], a["hub_id"], limits.DEFAULT_DATASET_CHOICE, a["size"], a["test_size"], 0, 15,
                               a["methods"], a["gamma"], a["weight_decay"], "random", "fast", a["epochs"], a["lr"]))


def test_the_learning_rate_box_reaches_the_recipe(default_model):
    """A typed learning rate is the recipe's: the app's paper-recipe run equals the library's fit with that lr,
    and differs from the recipe's own lr."""
    from nctv.calibration import NeuralClamping

    nc = cal_tab.parse_nc_options("paper", "default", 2, " 0.05 ", gamma="1", init="random")
    assert nc.setting("lr") == 0.05
    assert cal_tab.parse_nc_options("paper", "default", 2, "default", gamma="1").setting("lr") is None
    result, _ = cal_tab.run_calibration(SMALL, ["Neural Clamping (FL)"], 15, nc)
    cal, _ = data_splits(default_model, calibration_size=SMALL.calibration_size, calibration_seed=0,
                         test_size=SMALL.test_size)
    x, y = cal.tensors()
    t = result.methods["Neural Clamping (FL)"].params["temperature"]
    typed = NeuralClamping(default_model.model, gamma=1.0, fitter="paper", epochs=2, lr=0.05, seed=0).fit(x, y)
    own = NeuralClamping(default_model.model, gamma=1.0, fitter="paper", epochs=2, seed=0).fit(x, y)
    assert t == pytest.approx(typed.temperature_, rel=1e-6)
    assert abs(t - own.temperature_) > 1e-3


def test_parsing_helpers():
    def gamma(text):
        return NCOptions(gamma=text).setting("gamma")

    def parse_weight_decay(text):
        return NCOptions(weight_decay=text).setting("weight_decay")

    assert gamma(" Auto ") == "auto" and gamma("") == "auto" and gamma("0.5") == 0.5 and gamma("10") == 10
    for bad in ("-1", "nan", "inf", "x", "1e308", "10.5"):
        with pytest.raises(ValueError, match="^Focal-loss gamma \\(γ\\) must be a number from 0 to 10"):
            gamma(bad)
    assert parse_weight_decay("default") is None and parse_weight_decay(" Strong ") == "strong"
    assert parse_weight_decay("1e6") == 1e6
    for bad in ("-0.1", "1.1e6", "lots"):
        with pytest.raises(ValueError, match="from 0 to 1,000,000"):
            parse_weight_decay(bad)
    assert parse_whole("12", "n") == 12 and parse_whole(3.0, "n") == 3
    for bad in (2.5, "x", 0):
        with pytest.raises(ValueError):
            parse_whole(bad, "n", 1)


@pytest.mark.parametrize("available", [False, True])
def test_dataset_box_offers_hf_dataset_only_with_datasets(monkeypatch, available):
    monkeypatch.setattr(limits, "hub_datasets_available", lambda: available)
    monkeypatch.setenv("NCTV_DATA_ROOTS", "/srv/data")
    monkeypatch.setenv("NCTV_HUB_DATASETS", "1")  # what the operator allows; see below for the default
    assert "folder:/path" in limits.dataset_hint() and ("hf-dataset:" in limits.dataset_hint()) is available
    assert limits.dataset_choices()[0] == limits.DEFAULT_DATASET_CHOICE and "fashion-mnist" in limits.dataset_choices()
    assert not any(c.startswith("hf-dataset:") for c in limits.dataset_choices())  # a pattern, typed, never picked


def test_user_errors_turn_exceptions_into_messages():
    @user_errors
    def bad_value():
        raise ValueError("The picture is too large.")

    @user_errors
    def bug():
        raise RuntimeError("boom")

    @user_errors
    def gen():
        yield 1
        raise ValueError("stopped in the middle")

    @user_errors
    def full_device():
        raise DeviceOutOfMemoryError("The device cuda:0 ran out of memory even with a single image per call.")

    with pytest.raises(gr.Error, match="The picture is too large."):
        bad_value()
    with pytest.raises(gr.Error, match="cuda:0 ran out of memory even with a single image"):
        full_device()
    with pytest.raises(gr.Error, match="Something went wrong on the server \\(RuntimeError: boom\\)"):
        bug()
    g = gen()
    assert next(g) == 1
    with pytest.raises(gr.Error, match="stopped in the middle"):
        next(g)


def test_a_failed_run_says_so_in_its_status_line_and_keeps_the_rest():
    @user_errors(status_of=3)
    def run(size):
        yield "**Running** — loading the splits", gr.skip(), gr.skip()
        raise ValueError(f"Calibration size must be at least 10; got {size}.")

    g = run(0)
    assert next(g)[0].startswith("**Running**")
    status, *rest = next(g)
    assert status.startswith("**Error** — Calibration size must be at least 10; got 0.")
    assert "Running" not in status
    assert all(isinstance(r, dict) and r.get("__type__") == "update" and len(r) == 1 for r in rest)
    with pytest.raises(gr.Error, match="at least 10; got 0") as e:
        next(g)
    assert e.value.visible is False  # said once, on the status line: no toast repeats it


def test_time_left_follows_the_rate_of_the_running_task():
    now = [100.0]
    line = ProgressLine(clock=lambda: now[0])
    line.report("MS-ODIR (seed 0)", 4, 0.0)
    assert line.line().endswith("· estimating the time left")
    now[0] += 2
    assert line.line() is None  # nothing new to say: an idle poll redraws nothing
    now[0] += 8
    assert line.line().endswith("running for 10 s, no estimate yet")
    line.report("MS-ODIR: fold 2 of 4", SAME_TASK, 0.25)  # a quarter done in 10 s
    assert line.line() == "**Running** — MS-ODIR: fold 2 of 4 · about 30 s left"
    now[0] += 20
    line.report("MS-ODIR: fold 4 of 4", SAME_TASK, 0.75)
    assert line.line().endswith("about 10 s left")
    line.report("Dir-ODIR (seed 0)", 5, 0.0)  # the next method starts its own clock
    assert line.line().endswith("· estimating the time left")
    assert [duration(s) for s in (8.4, 125, 3720)] == ["8 s", "2 min 05 s", "1 h 02 min"]


def test_fold_progress_reads_the_fold_and_the_count():
    assert cal_tab.fold_message("MS-ODIR", {"fold": 2, "folds": 3}) == ("MS-ODIR: fold 2 of 3", pytest.approx(1 / 3))
    assert cal_tab.fold_message("MS-ODIR", {"passes": 2.0, "loss": 0.1}) is None
    assert cal_tab.fold_message("MS-ODIR", {"fold": 1, "folds": 0}) is None


# --------------------------------------------------------------------------- safe on a public server


def _calibrate(dataset: str, hub_id: str = "", methods=("Temperature Scaling",)) -> list:
    return list(cal_tab.calibrate(DEFAULT_MODEL, hub_id, dataset, 20, 20, 0, 5, list(methods), "1", "default",
                                  "random", "fast", 100))


def _refusal(dataset: str, hub_id: str = "") -> str:
    with pytest.raises(gr.Error) as e:
        _calibrate(dataset, hub_id)
    return str(e.value.message)


@pytest.mark.parametrize("roots", ["none", "a temporary root"])
def test_server_folders_are_refused_alike_and_reveal_nothing(roots, tmp_path, monkeypatch):
    if roots == "none":
        monkeypatch.delenv("NCTV_DATA_ROOTS", raising=False)
    else:
        (tmp_path / "data").mkdir()
        monkeypatch.setenv("NCTV_DATA_ROOTS", str(tmp_path / "data"))
    asked = ["folder:/etc", "folder:/no/such/folder", f"folder:{tmp_path}/data/../../../etc", "folder:~"]
    answers = {dataset: _refusal(dataset) for dataset in asked}
    assert len(set(answers.values())) == 1, answers  # the same sentence whether the folder exists or not
    message = answers["folder:/etc"]
    assert not re.search(r"/\w|\d", message)  # no path, no count
    # The server's own split loader refuses too, for a split built without the form.
    with pytest.raises(ValueError, match=re.escape(message)):
        caches.get_splits(session.SplitSpec(DEFAULT_MODEL, "folder:/etc", 20, 0, 20))


def test_an_allowed_root_serves_a_folder_of_classes(tmp_path, monkeypatch):
    # Real Fashion-MNIST test images of two classes, one folder per class named as the model names them.
    images, labels = data_load_pools("fashion-mnist").test
    root = tmp_path / "data"
    for cls in (1, 8):
        (root / "fmnist" / FMNIST_CLASSES[cls]).mkdir(parents=True)
        for i in np.flatnonzero(labels == cls)[:30]:
            images.pil(int(i)).save(root / "fmnist" / FMNIST_CLASSES[cls] / f"{i}.png")
    monkeypatch.setenv("NCTV_DATA_ROOTS", os.pathsep.join([str(tmp_path / "elsewhere"), str(root)]))
    dataset = f"folder:{root}/fmnist"
    status, *_, files, calibration, _shown_run = _calibrate(dataset)[-1]
    assert status.startswith("**Done**") and calibration.split.dataset == dataset
    data = json.loads(Path(next(f for f in files if f.endswith("results.json"))).read_text())
    assert data["calibration"]["name"] == f"{dataset} calibration" and data["calibration"]["size"] == 20
    # The same images the library reads from that folder without any root.
    _, test = data_splits(caches.get_model(DEFAULT_MODEL), dataset=dataset, calibration_size=20, test_size=20)
    assert data["test"]["fingerprint"] == test.fingerprint and set(test.labels.tolist()) <= {1, 8}


def _strings(value) -> list[str]:
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [k, *_strings(v)]]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def test_downloads_hold_no_server_path(run):
    result, calibration, _ = run
    files = [Path(f) for f in cal_tab.export_files(result, calibration, 15)]
    server = [str(Path(__file__).resolve().parent.parent), str(Path.home()), str(assets_dir())]
    for f in files + [precomputed_dir() / "results.json"]:
        if f.suffix in (".json", ".md", ".csv", ".tex"):
            text = f.read_text(encoding="utf-8")
            assert not [p for p in server if p in text], f
    results = next(f for f in files if f.name == "results.json")
    for f in (results, precomputed_dir() / "results.json"):
        data = json.loads(f.read_text(encoding="utf-8"))
        assert data["model"]["source"] == "local-dir:models/fmnist-resnet-overconfident"
        assert not [s for s in _strings(data) if s.startswith("/") or ":/" in s]


def test_messages_hide_the_servers_folders(monkeypatch):
    from huggingface_hub import constants

    # Offline, an uncached Hub model's message names the Hugging Face cache for a local user.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    message = _refusal(limits.DEFAULT_DATASET_CHOICE, hub_id="nctv-test/never-downloaded")
    assert "needs the network" in message and f"cache ({SERVER_PATH})" in message
    assert constants.HF_HUB_CACHE not in message and str(Path.home()) + "/" not in message

    @user_errors
    def missing_asset():
        raise ValueError(f"The embedded file {assets_dir()}/data/x.npz is missing; see {Path.home()}.")

    with pytest.raises(gr.Error) as e:
        missing_asset()
    assert e.value.message == f"The embedded file {SERVER_PATH}/data/x.npz is missing; see {SERVER_PATH}."


def test_hub_datasets_and_folders_are_offered_only_when_allowed(monkeypatch):
    monkeypatch.delenv("NCTV_DATA_ROOTS", raising=False)
    monkeypatch.delenv("NCTV_HUB_DATASETS", raising=False)
    assert limits.dataset_hint() is None
    assert "NCTV_HUB_DATASETS" in _refusal("hf-dataset:org/name@test")
    monkeypatch.setenv("NCTV_HUB_DATASETS", "1")
    assert limits.resolve_dataset("hf-dataset:org/name@test") == "hf-dataset:org/name@test"
    # A typed id is a Hub id: no server folder of that name is looked at.
    assert limits.resolve_model_name(DEFAULT_MODEL, "timm/resnet18.a1_in1k") == "hf-hub:timm/resnet18.a1_in1k"
    assert limits.resolve_model_name(None, "fmnist-vit") == "fmnist-vit"


def test_operator_limits_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("NCTV_MAX_MODEL_MB", raising=False)
    assert max_model_bytes() == 500 * 10**6
    monkeypatch.setenv("NCTV_MAX_MODEL_MB", "250")
    assert max_model_bytes() == 250 * 10**6
    monkeypatch.setenv("NCTV_MAX_MODEL_MB", "lots")
    with pytest.raises(ValueError, match="NCTV_MAX_MODEL_MB must be a number ≥ 0; it is 'lots'"):
        max_model_bytes()
    # The model memo's size is read once, when the app starts.
    script = "from nctv.ui import caches; print(caches._models.maxsize)"
    env = {**os.environ, "NCTV_MAX_MODELS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr[-2000:]


# --------------------------------------------------------------------------- images


def test_images_refuse_non_images_huge_images_and_empty_input(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a picture")
    with pytest.raises(ImageError, match="not an image"):
        to_pil(str(text))
    huge = tmp_path / "huge.png"
    Image.new("1", (10_000, 10_000)).save(huge)
    with pytest.raises(ImageError, match="megapixels"):
        to_pil(str(huge))
    with pytest.raises(ImageError, match="megapixels"):
        to_pil(np.zeros((7000, 7000), dtype=np.uint8))
    assert 7000 * 7000 > MAX_PIXELS
    with pytest.raises(ImageError, match="No image yet"):
        to_pil(None)
    with pytest.raises(ImageError, match="shape"):
        to_pil(np.zeros((4, 4, 2), dtype=np.uint8))
    with pytest.raises(ImageError, match="more than 20 times"):
        to_pil(np.zeros((3, 100), dtype=np.uint8))


def test_sideways_phone_pictures_are_turned_upright(tmp_path):
    img = Image.new("L", (30, 20))
    exif = img.getexif()
    exif[274] = 6  # EXIF orientation: stored rotated by 90°
    path = tmp_path / "phone.jpg"
    img.save(path, exif=exif)
    assert to_pil(str(path)).size == (20, 30)


def test_checked_image_turns_decoder_errors_into_messages(tmp_path):
    from gradio.data_classes import ImageData

    text = tmp_path / "notes.png"
    text.write_text("not a picture")
    comp = CheckedImage(type="filepath", image_mode=None, render=False)
    with pytest.raises(gr.Error, match="not an image"):
        comp.preprocess(ImageData(path=str(text), orig_name="notes.png"))
    huge = tmp_path / "huge.png"
    Image.new("1", (10_000, 10_000)).save(huge)
    with pytest.raises(gr.Error, match="too large"):
        comp.preprocess(ImageData(path=str(huge), orig_name="huge.png"))
    ok = tmp_path / "ok.png"
    Image.new("L", (5, 4), 7).save(ok)
    assert comp.preprocess(ImageData(path=str(ok), orig_name="ok.png")) == str(ok)


def test_pictures_are_measured_in_decoded_bytes_from_their_header(tmp_path):
    from test_hostile_http import png

    deep = tmp_path / "deep.png"
    deep.write_bytes(png(4000, 4000, 16, 6))  # 16 megapixels, 8 bytes each: 128 MB
    with Image.open(deep) as img:
        assert decoded_bytes(img) == 4000 * 4000 * 8
    with pytest.raises(ImageError, match="128 MB once decoded .* 4 channels of 16 bits.*at most 120 MB"):
        to_pil(str(deep))
    flat = tmp_path / "flat.png"
    flat.write_bytes(png(4000, 4000, 8, 6))  # the same picture in 8 bits: 64 MB
    assert to_pil(str(flat)).size == (4000, 4000)
    grey = tmp_path / "grey.png"
    grey.write_bytes(png(30, 20, 16, 0))
    with Image.open(grey) as img:  # the header's promise is what decoding takes: 16-bit grey is kept in 2
        need = decoded_bytes(img)    # bytes a pixel ("I;16") by recent Pillow, in 4 ("I") by Pillow 10.0
        assert need == len(img.tobytes()) and need in (30 * 20 * 2, 30 * 20 * 4)


def test_inline_pictures_are_capped_before_decoding_and_kept_as_sent():
    import base64

    from gradio.data_classes import ImageData
    from test_hostile_http import png

    comp = CheckedImage(type="filepath", image_mode=None, render=False)
    small = png(30, 20, 8, 0)
    path = comp.preprocess(ImageData(url="data:image/png;base64," + base64.b64encode(small).decode()))
    assert Path(path).read_bytes() == small and path in comp.temp_files  # not re-encoded; deleted with uploads
    assert ui_images.MAX_UPLOAD_BYTES == 25 * 2**20
    over = "data:image/png;base64," + "A" * (4 * 10**7)  # 30 MB once decoded
    with pytest.raises(gr.Error, match="sent inline is about 30.0 MB; this app accepts at most 26.2 MB"):
        comp.preprocess(ImageData(url=over))
    with pytest.raises(gr.Error, match="not valid base64"):
        comp.preprocess(ImageData(url="data:image/png;base64,%%%%"))


def test_drawings_waiting_to_be_read_are_bounded(monkeypatch):
    from gradio.components.image_editor import AcceptBlobs
    from test_hostile_http import png

    sketch = CheckedSketchpad(type="numpy", image_mode="RGB", render=False)
    blob = png(28, 28, 8, 2)
    monkeypatch.setattr(ui_images, "PENDING_DRAWING_BYTES", 2 * len(blob))
    for i in range(5):
        sketch.accept_blobs(AcceptBlobs(data={"type": "composite", "index": None, "file": b"", "id": str(i)},
                                        files=[("blob", blob)]))
    assert list(sketch.blob_storage) == ["3", "4"]  # the newest, within the bound
    with pytest.raises(gr.Error, match="8900 × 8900 pixels"):
        sketch.accept_blobs(AcceptBlobs(data={"type": "composite", "index": None, "file": b"", "id": "x"},
                                        files=[("blob", png(8900, 8900, 8, 0))]))
    drawing = sketch.preprocess(sketch.data_model(id="4"))
    assert drawing["composite"].shape == (28, 28, 3)


def test_long_values_are_refused_or_quoted_only_in_part(monkeypatch):
    from nctv.data import load_pools
    from nctv.zoo import parse_model_id

    with pytest.raises(ValueError, match="^Focal-loss gamma \\(γ\\) is 5,000 characters long; at most 1,000"):
        NCOptions(gamma="1" * 5000)
    with pytest.raises(ValueError, match="^The model name is 2,000 characters long"):
        parse_model_id("m" * 2000)
    with pytest.raises(ValueError) as e:
        parse_whole("y" * 900, "Seed")
    assert str(e.value) == "Seed must be a whole number; got '" + "y" * 80 + "'…."
    with pytest.raises(ValueError) as e:
        load_pools("q" * 900)
    assert str(e.value).startswith("Unknown dataset '" + "q" * 80 + "'…; known:") and "q" * 81 not in str(e.value)
    # Gradio's upload folder is a server folder wherever it is; a message is never longer than 600.
    monkeypatch.setenv("GRADIO_TEMP_DIR", "/srv/gradio-uploads")
    assert redact("see /srv/gradio-uploads/ab12/x.png") == f"see {SERVER_PATH}/ab12/x.png"
    assert len(redact("z" * 10**6)) == 601


def test_channel_conversion_both_ways():
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8))
    grey, note = match_channels(rgb, 1)
    assert grey.mode == "L" and "converted to grey" in note
    assert np.array_equal(np.asarray(grey), np.asarray(rgb.convert("L")))
    g = Image.fromarray(np.arange(30, dtype=np.uint8).reshape(6, 5))
    colour, note = match_channels(g, 3)
    assert colour.mode == "RGB" and "three colour channels" in note
    assert all(np.array_equal(np.asarray(colour)[..., c], np.asarray(g)) for c in range(3))
    same, note = match_channels(g, 1)
    assert note == "" and np.array_equal(np.asarray(same), np.asarray(g))
    # 16-bit grey keeps its top 8 bits.
    deep = (np.arange(600).reshape(30, 20) * 100).astype(np.uint16)
    eight, _ = match_channels(Image.fromarray(deep), 1)
    assert np.array_equal(np.asarray(eight), (deep >> 8).astype(np.uint8))
    # Transparency is painted over black, Fashion-MNIST's background.
    rgba = Image.new("RGBA", (2, 2), (255, 255, 255, 0))
    flat, _ = match_channels(rgba, 1)
    assert np.asarray(flat).max() == 0


# --------------------------------------------------------------------------- try your own image


def _softmax(z: torch.Tensor) -> np.ndarray:
    return torch.softmax(z.double(), dim=-1)[0].numpy()


_ROW = re.compile(r'<div class="nctv-class" data-class="([^"]*)"><div class="nctv-class-name">([^<]*)</div>(.*?)'
                  r'(?=<div class="nctv-class"|</div></div></div>$)')
_BAR = re.compile(r'data-method="(\w+)" data-confidence="([^"]*)".*?<span class="nctv-value">([^<]*)</span>')


def chart(page: str) -> dict[str, dict[str, float]]:
    """{class: {method: probability}} read from the data attributes of a confidence chart, after
    checking that each class is named in full and each bar shows its probability with one decimal."""
    out = {}
    for name, shown_name, bars in _ROW.findall(page):
        assert shown_name == name
        out[html.unescape(name)] = {}
        for method, p, shown in _BAR.findall(bars):
            p, shown = float(p), html.unescape(shown)
            assert re.fullmatch(r"([<>]\u00a0)?\d{1,3}\.\d\u00a0%", shown), shown  # never broken apart
            if shown[0] not in "<>":
                assert float(shown[:-2]) == pytest.approx(100 * p, abs=0.05)
            out[html.unescape(name)][method] = p
    return out


def _assert_three_calibrations(model, picture, cal, page):
    """The chart's rows are the classes in any method's top 5, most likely first, with the
    uncalibrated, TS and NC probabilities computed here from the model."""
    rows = chart(page)
    x = model.preprocess(picture)
    z = model_logits(model.model, x[None])
    expected = {"raw": _softmax(z), "ts": _softmax(z / cal.ts_temperature),
                "nc": _softmax(model_logits(model.model, x[None], delta=cal.delta) / cal.nc_temperature)}
    top = {model.class_names[int(i)] for p in expected.values() for i in np.argsort(-p)[:5]}
    assert set(rows) == top and len(rows) >= 5
    assert [expected["raw"][model.class_names.index(c)] for c in rows] == sorted(
        (expected["raw"][model.class_names.index(c)] for c in rows), reverse=True)
    for name, bars in rows.items():
        i = model.class_names.index(name)
        assert bars == pytest.approx({m: float(p[i]) for m, p in expected.items()})


def test_classify_shows_three_calibrations_of_the_same_picture(run, default_model, tmp_path):
    _, calibration, _ = run
    example = try_image.example_images()[0]
    verdict, page, view, note = try_image.classify(example, calibration)
    _assert_three_calibrations(default_model, Image.open(example), calibration, page)
    assert 'data-flagged="false"' in verdict and 'data-flagged="false"' in page and "nctv-chart nctv-dim" not in page
    assert "your run" in note and "canvas" in view
    # The run's own splits (300 calibration images) feed the out-of-distribution check.
    assert "This model knows 10 classes: T-shirt/top, Trouser" in note and "300 calibration images" in note


def test_classify_without_a_run_uses_the_shipped_calibration_and_converts_colour(tmp_path, default_model):
    cal = load_precomputed().calibration
    rgb = tmp_path / "colour.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(rgb)
    _, page, _, note = try_image.classify(str(rgb), None)
    assert PRECOMPUTED_LABEL in note and "converted to grey" in note and "40 × 30" not in note
    _assert_three_calibrations(default_model, Image.open(rgb).convert("L"), cal, page)


def test_the_delta_view_carries_the_calibrations_delta_in_pixel_levels(default_model):
    cal = load_precomputed().calibration
    example = try_image.example_images()[3]
    _, _, view, _ = try_image.classify(example, None)
    attrs = dict(re.findall(r'data-(\w+)="([^"]*)"', view.split(">", 1)[0]))
    std = torch.tensor(default_model.data_config["std"], dtype=torch.float64).reshape(-1, 1, 1)
    mean = torch.tensor(default_model.data_config["mean"], dtype=torch.float64).reshape(-1, 1, 1)
    x = default_model.preprocess(Image.open(example)).double()
    assert (attrs["channels"], attrs["height"], attrs["width"]) == ("1", "28", "28")
    # The shared viewer (nctv.ui.delta), on the visitor's picture, its buttons named apart from Calibrate's.
    assert "Your picture as the model gets it (28\u00a0×\u00a028)" in view
    assert view.count(f'name="{try_image.DELTA_GROUP}"') == 3 and 'name="calibrate-amplify"' not in view
    np.testing.assert_allclose(json.loads(attrs["delta"]), (255 * cal.delta.double() * std).numpy().ravel(), atol=1e-4)
    np.testing.assert_allclose(json.loads(attrs["input"]), (255 * (x * std + mean).clamp(0, 1)).numpy().ravel(),
                               atol=1e-3)
    assert float(attrs["largest"]) == pytest.approx(float((255 * cal.delta.double() * std).abs().max()))
    # The sentence gives the same largest change, on the 0–255 scale and as a share of it.
    largest = float(attrs["largest"])
    assert f"its largest change is {largest:.1f} of 255 grey levels, {100 * largest / 255:.1f} % of the image" in view
    # What δ alone does here: NC's top class at NC's T, without and with δ.
    z = model_logits(default_model.model, x.float()[None])
    with_delta = _softmax(model_logits(default_model.model, x.float()[None], delta=cal.delta) / cal.nc_temperature)
    top = int(np.argmax(with_delta))
    assert html.escape(f"from {try_image.percent(float(_softmax(z / cal.nc_temperature)[top]))} (Neural Clamping's "
                       f"temperature alone) to {try_image.percent(float(with_delta[top]))}") in view


def test_grey_picture_for_a_colour_model(tmp_path):
    # A small colour model trained here for seconds: the embedded models all read grey images.
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 16, 16, 3), dtype=np.uint8)
    labels = np.arange(64) % 3
    folder = tmp_path / "rgb-model"
    train_classifier("resnet10t", dict(channels=[8, 8, 8, 8], stem_width=4), (images, labels), out_dir=folder,
                     class_names=["a", "b", "c"], epochs=1, batch_size=32, progress=False)
    name = f"local-dir:{folder}"
    cal = session.Calibration(None, name, ts_temperature=2.0, nc_temperature=None, delta=None, nc_method=None,
                            source="a test calibration")
    grey = tmp_path / "grey.png"
    Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(grey)
    verdict, page, view, note = try_image.classify(str(grey), cal)
    assert "three colour channels" in note and "was not part of this run" in note
    assert "knows 3 classes: a, b, c" in note and "check is unavailable: this calibration came without its images" in verdict
    assert 'data-flagged="unknown"' in verdict and "no δ to show" in view and "Neural Clamping was not part" in page
    loaded = caches.get_model(name)
    z = model_logits(loaded.model, loaded.preprocess(Image.open(grey).convert("RGB"))[None])
    rows = chart(page)
    assert set(rows) == {"a", "b", "c"} and all(set(bars) == {"raw", "ts"} for bars in rows.values())
    for i, c in enumerate("abc"):
        assert rows[c] == pytest.approx({"raw": float(_softmax(z)[i]), "ts": float(_softmax(z / 2.0)[i])})


def test_drawings_are_classified_and_empty_ones_refused():
    canvas = np.zeros((280, 280, 3), dtype=np.uint8)
    with pytest.raises(gr.Error, match="empty"):
        try_image.classify_drawing({"background": canvas, "layers": [], "composite": canvas}, None)
    drawn = canvas.copy()
    drawn[60:220, 100:180] = 255  # a bright block: something trouser-like
    _, page, _, note = try_image.classify_drawing({"background": canvas, "layers": [], "composite": drawn}, None)
    rows = chart(page)
    assert "280 × 280" in note and len(rows) >= 5 and all(len(bars) == 3 for bars in rows.values())


def _text_page() -> Image.Image:
    """A white page with dark strokes like lines of text: nothing like Fashion-MNIST."""
    page = Image.new("L", (300, 400), 255)
    draw = ImageDraw.Draw(page)
    for y in range(20, 380, 30):
        for x in range(20, 260, 45):
            draw.line([(x, y), (x + 35, y)], fill=30, width=3)
    return page


def test_a_foreign_picture_is_flagged_first_and_its_answer_marked(tmp_path):
    page = tmp_path / "page.png"
    _text_page().save(page)
    verdict, bars, _, note = try_image.classify(str(page), None)
    assert 'data-flagged="true"' in verdict and html.escape(try_image.MEANS_LITTLE) in verdict
    assert bars.startswith('<div class="nctv-chart" data-flagged="true">') and len(chart(bars)) >= 5
    # The answer is marked in words (and nothing greyed out: tests/test_readable_browser.py).
    assert f'<span class="nctv-flag">⚠ {html.escape(try_image.FLAGGED_ANSWER)}</span>' in bars
    assert "the 99th percentile on 1,000 test images" in note and "Mahalanobis distance" in note
    assert "2,000 calibration images" in note
    passed, bars, *_ = try_image.classify(try_image.example_images()[0], None)
    assert 'data-flagged="false"' in passed and "looks like the data the model knows" in passed
    assert 'data-flagged="false"' in bars and "nctv-flag" not in bars
    # The shipped calibration's images are the page's default splits: the check fits on exactly them.
    pre = load_precomputed()
    assert caches.get_splits(pre.split)[0].fingerprint == pre.result.calibration["fingerprint"]


def test_the_ood_check_is_unavailable_rather_than_failing(tmp_path):
    cal = dataclasses.replace(load_precomputed().calibration, source="a test calibration",
                              split=session.SplitSpec(DEFAULT_MODEL, "folder:/no/such/folder", 20, 0, 20))
    verdict, page, *_ = try_image.classify(try_image.example_images()[0], cal)
    assert "check is unavailable: its images could not be loaded" in verdict and len(chart(page)) >= 5
    assert "nctv-flag" not in page


def test_nothing_to_classify_gives_the_hint_and_no_earlier_result():
    verdict, page, view, note = try_image.classify(None, None)
    assert try_image.HINT in verdict and page == view == note == ""
    assert (verdict, page, view, note) == try_image.cleared()


def test_the_chart_shows_one_decimal_and_escapes_names():
    names = ["<b>bag</b>", 'a "quoted" & name', "tiny", "none"]
    probs = {"raw": np.array([0.8734, 0.12, 0.00001, 0.0]), "ts": np.array([0.5, 0.3, 0.1, 0.1]),
             "nc": np.array([0.99996, 0.00004, 0.0, 0.0])}
    page = try_image.confidence_chart(names, probs)
    assert "<b>bag</b>" not in page
    assert chart(page) == {n: {m: float(p[i]) for m, p in probs.items()} for i, n in enumerate(names)}
    page = page.replace("\u00a0", " ")  # a number and its unit are joined by a non-breaking space
    assert ">87.3 %<" in page and ">12.0 %<" in page and ">&lt; 0.1 %<" in page and ">0.0 %<" in page
    assert ">&gt; 99.9 %<" in page and "The model's answer: <b>&lt;b&gt;bag&lt;/b&gt;</b>" in page
    assert try_image.percent(0.99996) == ">\u00a099.9\u00a0%" and try_image.percent(1.0) == "100.0\u00a0%"
    assert try_image.confidence_chart(names, {}) == ""
    with pytest.raises(ValueError, match="from 0 to 1"):
        try_image.confidence_chart(names, {"raw": np.array([1.5, 0, 0, 0])})
    with pytest.raises(ValueError, match="one per class"):
        try_image.confidence_chart(names, {"raw": np.array([1.0])})
    # Neural Clamping's own answer is named when it differs.
    flipped = try_image.confidence_chart(["a", "b"], {"raw": np.array([0.6, 0.4]), "ts": np.array([0.55, 0.45]),
                                                      "nc": np.array([0.4, 0.6])})
    assert "The model's answer: <b>a</b> (with Neural Clamping: <b>b</b>)" in flipped
    many = try_image.classes_sentence([f"class {i}" for i in range(1000)])
    assert many.startswith("This model knows 1,000 classes, among them class 0, class 1") and "class 999" not in many


# --------------------------------------------------------------------------- learn


def test_learn_recomputes_metrics_at_the_slider_temperature():
    pre = load_precomputed()
    z, y = pre.result.methods["Uncalibrated"].test_logits, pre.result.test_labels
    fig, table, text = learn.explore_temperature(2.0, 10, None)
    row = _row(table, "T = 2.00 (slider)")
    assert float(row[3]) == pytest.approx(round(100 * metrics.ece(z / 2.0, y, 10), 2))
    assert float(row[2]) == pytest.approx(round(metrics.entropy(z / 2.0), 4))
    assert float(_row(table, "T = 1 (uncalibrated)")[1]) == pytest.approx(round(100 * metrics.accuracy(z, y), 2))
    assert f"{100 * metrics.ece(z / 2.0, y, 10):.2f}%" in text and "10 bins" in text
    assert len(fig.data) == 8  # two diagrams of four traces each
    with pytest.raises(gr.Error, match="between"):
        learn.explore_temperature(0.0, 15, None)
    with pytest.raises(gr.Error, match="between 0.05 and 5; got 7"):
        learn.explore_temperature(7, 15, None)
    assert learn.explain(2.0, 10, None) == (table, text)


def _decoded(data: dict) -> tuple[np.ndarray, np.ndarray]:
    z = np.frombuffer(base64.b64decode(data["logits"]), dtype="<f4").reshape(data["n"], data["k"])
    return z, np.frombuffer(base64.b64decode(data["labels"]), dtype="<i4")


def test_learn_page_gets_the_test_logits_once_whole_or_sampled(monkeypatch):
    pre = load_precomputed()
    z, y = pre.result.methods["Uncalibrated"].test_logits, pre.result.test_labels
    data = learn.page_data(None)
    got_z, got_y = _decoded(data)
    assert np.array_equal(got_z, z.numpy()) and np.array_equal(got_y, y.numpy())
    assert data["n"] == data["n_total"] == 10_000 and data["ts_temperature"] == pre.calibration.ts_temperature
    # A split with more logits than the page takes goes as a seeded sample of whole rows, in order.
    monkeypatch.setattr(learn, "PAGE_MAX_VALUES", 25_000)
    sample = learn.page_data(None)
    assert sample["n"] == 2_500 and sample["n_total"] == 10_000 and sample == learn.page_data(None)
    sz, sy = _decoded(sample)
    rows = {tuple(r): label for r, label in zip(z.numpy().tolist(), y.numpy().tolist())}
    assert len({tuple(r) for r in sz.tolist()}) == 2_500
    assert all(rows[tuple(r)] == label for r, label in zip(sz.tolist(), sy.tolist()))


def test_learn_follows_the_visitors_run(run, splits, logits):
    _, calibration, _ = run
    y_test = splits[1][1]
    z = logits[1]
    _, table, text = learn.explore_temperature(1.0, 15, calibration)
    assert float(_row(table, "T = 1 (uncalibrated)")[3]) == pytest.approx(round(100 * metrics.ece(z, y_test), 2))
    assert "your run" in text


# --------------------------------------------------------------------------- γ sweep and initialisation


def test_gamma_grid():
    assert gamma_tab.gamma_grid(0, 1, 0.25) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert gamma_tab.gamma_grid(0, 1, 0.05)[-1] == 1.0 and len(gamma_tab.gamma_grid(0, 1, 0.05)) == 21
    assert gamma_tab.gamma_grid(2, 2, 1) == [2.0]
    for args, words in [((-1, 1, 0.1), "≥ 0"), ((1, 0, 0.1), "end at or above"), ((0, 1, 0), "positive"),
                        ((0, 10, 0.01), "at most"), ((0, 1e308, 1e306), "at most 10")]:
        with pytest.raises(ValueError, match=words):
            gamma_tab.gamma_grid(*args)


def test_gamma_sweep_handler_marks_the_gamma_with_lowest_calibration_ece():
    outs = list(gamma_tab.gamma_sweep(*SHARED, 0, 1, 0.5, "auto", "random", "fast", 100))
    status, fig, table, files = outs[-1]
    assert status.startswith("**Done**")
    data = json.loads(Path(files[0]).read_text())
    eces = data["splits"]["calibration"]["ece"]
    assert data["gammas"] == [0.0, 0.5, 1.0] and data["chosen_gamma"] == data["gammas"][int(np.argmin(eces))]
    assert f"**Chosen γ = {data['chosen_gamma']:g}**" in table
    assert {t.name for t in fig.data} >= {"calibration", "test"}


def test_init_study_handler_reports_both_initialisations():
    outs = list(init_tab.init_study(*SHARED, 2, "1", "auto", "fast", 100))
    status, fig, table, files = outs[-1]
    data = json.loads(Path(files[0]).read_text())
    assert set(data["runs"]) == {"random", "data"} and len(data["runs"]["random"]) == 2
    for init, label in (("random", "Random δ₀"), ("data", "Data-driven δ₀ (Theorem 1)")):
        eces = [100 * r["ece"] for r in data["runs"][init]]
        # The mean over runs with the interval of that mean from resampling the test split (runs redrawn).
        ci = data["ci"][init]["ece"]
        shown = f"{np.mean(eces):.2f} [{100 * ci['ci_low']:.2f}, {100 * ci['ci_high']:.2f}]"
        assert _row(table, label)[2].strip("*_") == shown
    assert len({r["ece"] for r in data["runs"]["data"]}) == 1
    assert {t.name for t in fig.data} == {"random", "data-driven", "mean, 95 % interval"}


def test_init_study_progress_reaches_its_end_before_done():
    """The fast fitter stops its fits before their budget: the planned total follows the fits'
    real lengths, so the last report before "done" is near the end and the count names the passes run."""
    reports = []
    result = init_tab.run_study(SMALL, 3, 15, NCOptions(), reports.append)
    steps = [(f, m) for _, f, m in reports if "passes" in m]
    fractions = [f for f, _ in steps]
    final = re.search(r"about (\d+) of (\d+) passes", steps[-1][1])
    assert int(final[2]) == round(result.study.n_passes)  # the last plan is the passes the study ran
    assert fractions[-1] >= 0.95
    assert max(b - a for a, b in zip(fractions, fractions[1:])) < 0.2  # no jump to the end


#: Every Neural Clamping field of the tabs at a value that is not its default: γ, λ, the paper
#: recipe with one epoch, its learning rate, and the data-driven initialisation.
NON_DEFAULT = {"gamma": 0.5, "weight_decay": 0.02, "fitter": "paper", "epochs": 1, "lr": 0.005, "init": "data"}


def test_calibrate_handler_hands_every_setting_to_the_fitted_object(tmp_path):
    """The Calibrate tab's fields reach the Neural Clamping that was fitted: the calibrator the run
    offers for download (saved from the fitted object itself) holds each one."""
    v = NON_DEFAULT
    outs = list(cal_tab.calibrate(DEFAULT_MODEL, "", limits.DEFAULT_DATASET_CHOICE, 300, 200, 0, 15,
                                  ["Neural Clamping (FL)"], str(v["gamma"]), str(v["weight_decay"]), v["init"],
                                  v["fitter"], v["epochs"], str(v["lr"])))
    files, calibration = outs[-1][-3], outs[-1][-2]
    archive = next(f for f in files if f.endswith("calibrators.zip"))
    with zipfile.ZipFile(archive) as z:
        config = json.loads(z.read("neural-clamping-fl/config.json"))
    assert {k: config["params"][k] for k in v} == v
    assert config["fitted"]["gamma_"] == 0.5 and config["fitted"]["weight_decay_"] == 0.02
    assert {k: calibration.settings["nc"][k] for k in v} == v


def test_gamma_and_initialisation_tabs_hand_every_setting_to_the_fit():
    """The γ sweep and initialisation tabs build the same options from their fields: each run records
    the options its fits were built with, and the sweep fits the grid's γ values with them."""
    v = NON_DEFAULT
    outs = list(gamma_tab.gamma_sweep(DEFAULT_MODEL, "", limits.DEFAULT_DATASET_CHOICE, 200, 200, 0, 15, 0, 0.5, 0.5,
                                      str(v["weight_decay"]), v["init"], v["fitter"], v["epochs"], str(v["lr"])))
    sweep = json.loads(Path(outs[-1][-1][0]).read_text())
    given = {k: x for k, x in v.items() if k != "gamma"}  # the sweep sets γ itself
    assert {k: sweep["settings"]["nc"][k] for k in given} == given
    assert sweep["gammas"] == [0.0, 0.5] and sweep["fitter"] == "paper" and sweep["weight_decay"] == [0.02, 0.02]
    outs = list(init_tab.init_study(DEFAULT_MODEL, "", limits.DEFAULT_DATASET_CHOICE, 200, 200, 0, 15, 1,
                                    str(v["gamma"]), str(v["weight_decay"]), v["fitter"], v["epochs"], str(v["lr"])))
    study = json.loads(Path(outs[-1][-1][0]).read_text())
    given = {k: x for k, x in v.items() if k != "init"}  # the study sets the initialisation itself
    assert {k: study["settings"]["nc"][k] for k in given} == given and study["fitter"] == "paper"


# --------------------------------------------------------------------------- the shipped result


def test_shipped_result_matches_the_shipped_model(default_model):
    pre = load_precomputed()
    assert pre is not None, "assets/precomputed is missing: run python scripts/make_precomputed.py"
    r = pre.result
    assert r.model["name"] == DEFAULT_MODEL
    assert r.model["fingerprint"] == model_fingerprint(default_model.model), \
        "the default model changed since assets/precomputed was made: run python scripts/make_precomputed.py"
    _, test = data_splits(default_model, calibration_size=None)
    assert r.test["fingerprint"] == test.fingerprint and torch.equal(r.test_labels, test.labels)
    # The stored logits are the model's: checked on a sample of the test split (a full pass is slow).
    part = test.subset(np.arange(0, len(test), 7))
    x, y = part.tensors()
    z = model_logits(default_model.model, x)
    assert torch.allclose(r.methods["Uncalibrated"].test_logits[::7], z, atol=1e-4)
    cal = pre.calibration
    assert cal.source == PRECOMPUTED_LABEL and tuple(cal.delta.shape) == tuple(x.shape[1:])
    z_nc = model_logits(default_model.model, x, delta=cal.delta) / cal.nc_temperature
    assert torch.allclose(r.methods[cal.nc_method].test_logits[::7], z_nc, atol=1e-4)
    full = r.methods["Uncalibrated"].test_logits
    shipped_ece = r.methods["Uncalibrated"].metrics[15]["ece"].mean
    assert shipped_ece == pytest.approx(metrics.ece(full, r.test_labels), abs=1e-6)
    examples = try_image.example_images()
    assert len(examples) == len(default_model.class_names)
    assert all(Image.open(p).size == (28, 28) for p in examples)


def test_first_screen_is_the_shipped_result():
    status, table, diagrams, params, delta, files = cal_tab.precomputed_view()
    assert PRECOMPUTED_LABEL in status and PRECOMPUTED_LABEL in table
    assert "| Neural Clamping (FL) |" in table and len(diagrams["methods"]) == 5 and delta is not None
    assert Path(files[0]).name == "calibrators.zip"
    # The parameters say in words how large δ is: its largest change in 0–255 levels, from the
    # shipped δ and the model's normalisation (x = (p / 255 − mean) / std, so Δp = 255 · std · δ).
    pre = load_precomputed()
    largest = 255 * float((pre.calibration.delta.abs() * torch.tensor(pre.result.settings["std"]).view(-1, 1, 1)).max())
    assert f"its largest change is {largest:.1f} of 255 grey levels" in params
    # The run's verdict on Neural Clamping, from the paired interval, stands under the table.
    assert "Neural Clamping (FL) and TS by Grid Search are tied on this model" in table or \
        "Neural Clamping (FL) is" in table
    shipped = json.loads(Path(next(f for f in files if f.endswith("results.json"))).read_text())
    assert shipped == json.loads((precomputed_dir() / "results.json").read_text())
    # The shipped run's calibrators come as a zip too, and load back as the run's own δ and T.
    from nctv.ui.upload_calibrator import load_calibrators

    archive = next(f for f in files if f.endswith("calibrators.zip"))
    loaded, line = load_calibrators(archive, None)
    pre = load_precomputed().calibration
    assert "Loaded **Neural Clamping (FL)**" in line and torch.equal(loaded.delta, pre.delta)
    assert loaded.nc_temperature == pre.nc_temperature and loaded.ts_temperature == pre.ts_temperature


def test_the_downloaded_reliability_diagrams_are_drawn_as_nctv_run_draws_them(monkeypatch, tmp_path):
    """reliability.png (.svg, .pdf) holds every method's binned diagram and smooth_reliability.png its
    smoothed one with its band, both from the numbers ``nctv run`` draws: each method's bins and
    nctv.intervals.smooth_band of the shipped test logits (read from their file here) at the run's
    interval settings."""
    from safetensors.torch import load_file

    from nctv import plots
    from nctv.intervals import smooth_band

    drawn, draw = [], plots.reliability_figure

    def spy(data, *args, **kwargs):
        fig = draw(data, *args, **kwargs)
        drawn.append((data, fig))
        return fig

    monkeypatch.setattr(plots, "reliability_figure", spy)
    pre = load_precomputed()
    files = cal_tab.figures_for_slides(pre.result, pre.calibration, 15, tmp_path)
    assert {"reliability.png", "smooth_reliability.png"} <= {Path(f).name for f in files} and len(drawn) == 2
    (data, binned), (same, fig) = drawn
    assert same is data and not any(ax.get_title().endswith("(smoothed)") for ax in binned.axes)
    saved = json.loads((precomputed_dir() / "results.json").read_text())
    how = saved["settings"]["intervals"]
    tensors = load_file(str(precomputed_dir() / "test_logits.safetensors"))
    labels = tensors.pop("labels").numpy()
    assert [d.method for d in data] == list(saved["methods"])
    for d in data:
        z = tensors[d.method]
        np.testing.assert_array_equal(d.counts, metrics.reliability_bins(z, labels, 15).counts)
        assert d.ece == pytest.approx(metrics.ece(z, labels, 15), abs=1e-12)
        conf, pred = metrics.confidences_and_predictions(z)
        band = smooth_band(conf, pred == labels, level=how["level"], resamples=how["resamples"], seed=how["seed"])
        assert d.smooth is not None and (d.smooth.level, d.smooth.resamples) == (0.95, 1000), d.method
        for field in ("confidence", "accuracy", "density", "low", "high"):
            np.testing.assert_allclose(getattr(d.smooth, field), getattr(band, field), atol=1e-12, err_msg=d.method)
        assert d.smooth.smooth_ece == pytest.approx(band.smooth_ece, abs=1e-12)
        assert (d.smooth.high - d.smooth.low).max() > 0.01  # a band, not a line
    # Drawn: each method's smoothed diagram on the second slide.
    titles = [ax.get_title().replace("\n", " ") for ax in fig.axes]
    assert [t for t in titles if t.endswith("(smoothed)")] == [f"{d.method} (smoothed)" for d in data]


def test_try_names_the_pictures_conformal_set_made_by_hand():
    """Try's sentence "With 90 % confidence the answer is one of: …" is the LAC set of split conformal
    prediction on temperature scaling's probabilities, computed here with numpy from the calibration
    split's logits: q̂ is the ⌈(n + 1)·0.9⌉-th smallest 1 − p_y, and the set holds every class with
    1 − p ≤ q̂. A picture unlike the model's data gets no set."""
    import math

    from nctv.ui import try_image
    from nctv.ui.caches import get_logits
    from nctv.ui.shipped import examples_dir, load_precomputed

    cal = load_precomputed().calibration
    z, y = get_logits(cal.split, "calibration")
    z, y = z.double().numpy(), y.numpy()
    p = np.exp(z / cal.ts_temperature - (z / cal.ts_temperature).max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    scores = np.sort(1 - p[np.arange(len(y)), y])
    q = scores[math.ceil((len(y) + 1) * 0.9) - 1]
    loaded = try_image.get_model(cal.model)
    seen = set()
    for picture in sorted(examples_dir().glob("*.png")):
        chart = try_image.classify(str(picture), None)[1]
        sentence = html.unescape(re.search(r'<p class="nctv-set">(.*?)</p>', chart).group(1)).replace("\u00a0", " ")
        x = loaded.preprocess(Image.open(picture))
        zi = try_image.model_logits(loaded.model, x[None]).double().numpy()[0] / cal.ts_temperature
        pi = np.exp(zi - zi.max())
        pi /= pi.sum()
        names = [loaded.class_names[k] for k in range(len(pi)) if 1 - pi[k] <= q]
        want = (f"With 90 % confidence the answer is {names[0]}." if len(names) == 1 else
                f"With 90 % confidence the answer is one of: {', '.join(names)}.")
        assert sentence == want
        seen.add(len(names))
    assert seen  # every example picture was answered with a set
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8))
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "nctv-noise.png"
    noise.save(path)
    verdict, chart, _, _ = try_image.classify(str(path), None)
    assert 'data-flagged="true"' in verdict and 'class="nctv-set"' not in chart
