"""The `nctv` command end to end on the embedded model (small splits, 2 seeds)."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from nctv import metrics
from nctv.cli import build_parser, resolve_methods

ROOT = Path(__file__).resolve().parent.parent


def nctv(*args, cwd, check=True):
    env = dict(os.environ, NCTV_CACHE_DIR=str(Path(cwd) / "cache"), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-m", "nctv.cli", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"nctv {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def test_help_has_examples_and_every_command():
    text = build_parser().format_help()
    for cmd in ("run", "ablation", "timing", "sweep-gamma", "init-study", "train", "models"):
        assert cmd in text
    assert "examples:" in text and "nctv run --seeds 2" in text
    assert resolve_methods(["ts", "NC-FL", "Dir-ODIR,ms"]) == ["Temperature Scaling", "Neural Clamping (FL)", "Dir-ODIR",
                                                                  "Matrix Scaling"]


@pytest.mark.parametrize("available", [False, True])
def test_dataset_help_names_every_dataset_and_hf_dataset_only_with_pyarrow(monkeypatch, capsys, available):
    from nctv.data import DATASETS

    monkeypatch.setattr("nctv.cli.hub_datasets_available", lambda: available)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse's wrapping undone
    assert ("hf-dataset:" in text) is available
    for name in DATASETS:  # the help is written out (the command line reads no dataset module to start)
        if not name.startswith("hf-dataset:"):
            assert name in text, name


def test_errors_are_one_line_with_exit_status_2(tmp_path):
    proc = nctv("run", "--model", "no-such-model", "--quiet", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nctv run: error: Unknown model 'no-such-model'")
    assert "Traceback" not in proc.stderr
    proc = nctv("run", "--methods", "platt", "--quiet", "--calibration-size", "100", "--test-size", "100",
                cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Unknown method 'platt'" in proc.stderr and "Traceback" not in proc.stderr


def test_models_lists_the_default(tmp_path):
    out = nctv("models", cwd=tmp_path).stdout
    assert "* fmnist-resnet" in out and "embedded" in out


@pytest.mark.slow
def test_run_end_to_end(tmp_path, default_model):
    out = tmp_path / "res"
    # The paper fitter with 2 epochs keeps this test short (the fast fitter is tested in test_experiment)
    # and shows that --fitter reaches the results.
    proc = nctv("run", "--seeds", "2", "--bins", "10", "15", "--calibration-size", "300", "--test-size", "400",
                "--methods", "uncal", "ts", "nc-fl", "nc-eff", "--fitter", "paper", "--epochs", "2", "--out", str(out),
                "--quiet", cwd=tmp_path)
    text = proc.stdout.strip()
    line = text.splitlines()[-1]
    assert line.startswith("run: 4 methods") and "fitter paper" in line and str(out) in line
    # Above the summary: the main table, every figure with its interval.
    assert text.startswith("**Calibration on the test split (15 bins)**") and "95 % interval" in text
    ts_row = next(r for r in text.splitlines() if r.startswith("| Temperature Scaling |"))
    assert ts_row.count(" [") == 6  # accuracy, entropy, ECE, AECE, SCE and smooth ECE
    for name in ("results.json", "table.md", "table.csv", "table.tex", "table.json", "test_logits.safetensors",
                 "delta.safetensors"):
        assert (out / name).stat().st_size > 0, name
    for fig in ("reliability", "confidence", "delta"):
        with Image.open(out / "figures" / f"{fig}.png") as im:
            assert im.format == "PNG" and im.width > 100
        assert (out / "figures" / f"{fig}.pdf").read_bytes().startswith(b"%PDF")
        assert "Plotly.newPlot" in (out / "figures" / f"{fig}.html").read_text()
    # Every method's smoothed diagram, with its band, beside its binned one.
    page = (out / "figures" / "reliability.html").read_text()
    assert page.count("(smoothed)") == 4 and "95 % band" in page
    data = json.loads((out / "results.json").read_text())
    assert data["fitter"] == "paper" and data["seeds"] == [0, 1] and data["test"]["size"] == 400
    assert data["methods"]["Neural Clamping (FL)"]["seeds"] == [0, 1]
    assert data["methods"]["Temperature Scaling"]["seeds"] == [0]
    # The table shows the JSON's numbers in the paper's units.
    rows = {(r["bins"], r["method"]): r for r in csv.DictReader((out / "table.csv").open())}
    for method, m in data["methods"].items():
        ece = m["metrics"]["15"]["ece"]["mean"]
        assert float(rows[("15", method)]["ECE (%)"]) == pytest.approx(100 * ece, rel=1e-12)
    # ... and the JSON's numbers are the metrics of the saved calibrated logits.
    from safetensors.torch import load_file

    saved = load_file(str(out / "test_logits.safetensors"))
    ts = metrics.evaluate(saved["Temperature Scaling"], saved["labels"], n_bins=10)
    assert data["methods"]["Temperature Scaling"]["metrics"]["10"]["sce"]["mean"] == pytest.approx(ts["sce"], abs=1e-12)
    md = (out / "table.md").read_text()
    assert "Welch" in md and "Neural Clamping fitter: paper" in md
    # The fitted calibrators are saved for nctv apply: the first seed's δ and T, as the run measured them.
    from nctv.calibration import load_calibrator

    assert sorted(p.name for p in (out / "calibrators").iterdir()) == [
        "nc-eff", "neural-clamping-fl", "temperature-scaling"]
    nc = load_calibrator(out / "calibrators" / "neural-clamping-fl", model=default_model)
    assert torch.equal(nc.delta_, load_file(str(out / "delta.safetensors"))["Neural Clamping (FL)"])
    assert nc.temperature_ == data["methods"]["Neural Clamping (FL)"]["params"]["temperature"]
    ts = load_calibrator(out / "calibrators" / "temperature-scaling")
    assert ts.temperature_ == data["methods"]["Temperature Scaling"]["params"]["temperature"]


@pytest.mark.slow
def test_sweep_gamma_and_init_study(tmp_path):
    small = ["--calibration-size", "200", "--test-size", "200", "--fitter", "paper", "--epochs", "1", "--quiet"]
    proc = nctv("sweep-gamma", "--gammas", "0", "1", "--out", str(tmp_path / "g"), *small, cwd=tmp_path)
    assert proc.stdout.startswith("sweep-gamma: 2 gammas") and "chosen gamma" in proc.stdout
    data = json.loads((tmp_path / "g" / "results.json").read_text())
    assert data["gammas"] == [0.0, 1.0] and set(data["splits"]) == {"calibration", "test"} and data["fitter"] == "paper"
    assert (tmp_path / "g" / "figures" / "gamma.png").exists() and (tmp_path / "g" / "table.md").exists()
    proc = nctv("init-study", "--seeds", "2", "--out", str(tmp_path / "i"), *small, cwd=tmp_path)
    assert proc.stdout.startswith("init-study: 2 runs") and "data-driven ECE" in proc.stdout
    assert (tmp_path / "i" / "figures" / "init_study.pdf").read_bytes().startswith(b"%PDF")


@pytest.mark.slow
def test_train_writes_a_loadable_model(tmp_path):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 3, 90)
    images = (rng.uniform(0, 1, (90, 8, 8)) * 80 + labels[:, None, None] * 60).astype(np.uint8)
    np.savez(tmp_path / "tiny.npz", train_images=images[:60], train_labels=labels[:60], test_images=images[60:],
             test_labels=labels[60:])
    proc = nctv("train", "--dataset", f"npz:{tmp_path / 'tiny.npz'}", "--arch", "resnet10t", "--model-arg",
                "channels=[4,8,8,8]", "--model-arg", "stem_width=4", "--epochs", "2", "--batch-size", "16",
                "--class-names", "a", "b", "c",
                "--out", str(tmp_path / "m"), "--quiet", cwd=tmp_path)
    assert proc.stdout.startswith("train: resnet10t") and "test accuracy" in proc.stdout
    from nctv import zoo

    loaded = zoo.load_model(f"local-dir:{tmp_path / 'm'}")
    assert loaded.class_names == ["a", "b", "c"] and loaded.input_shape == (1, 8, 8)


def test_run_takes_every_neural_clamping_setting(tmp_path, default_model):
    """λ, the δ initialisation, the learning rate, γ = auto, the fitter and the calibration seed reach the
    fitted Neural Clamping: the calibrator the run saved holds them, and refits to the same T."""
    from nctv import data
    from nctv.calibration.clamping import NeuralClamping

    out = tmp_path / "res"
    nctv("run", "--seeds", "1", "--bins", "15", "--calibration-size", "200", "--test-size", "200",
         "--calibration-seed", "3", "--methods", "uncal", "nc-fl", "--fitter", "toolkit", "--epochs", "1",
         "--gamma", "auto", "--weight-decay", "0.05", "--init", "data", "--lr", "0.02", "--out", str(out), "--quiet",
         cwd=tmp_path)
    res = json.loads((out / "results.json").read_text())
    nc = res["methods"]["Neural Clamping (FL)"]["params"]
    given = {"gamma": "auto", "weight_decay": 0.05, "init": "data", "fitter": "toolkit", "epochs": 1, "lr": 0.02}
    assert {k: res["settings"]["nc"][k] for k in given} == given and res["fitter"] == "toolkit"
    # The calibrator saved from the fitted object records the settings it was fitted with.
    fitted = json.loads((out / "calibrators" / "neural-clamping-fl" / "config.json").read_text())
    assert {k: fitted["params"][k] for k in given} == given
    cal, _ = data.get_splits(default_model, calibration_size=200, calibration_seed=3, test_size=200)
    assert res["calibration"]["fingerprint"] == cal.fingerprint
    # The library fitted with these settings chooses the same γ and learns the same T: every setting arrived.
    lib = NeuralClamping(default_model.model, gamma="auto", fitter="toolkit", epochs=1, weight_decay=0.05, init="data",
                         lr=0.02, seed=0, input_range=default_model.input_range, progress=False)
    lib.fit(cal.loader(batch_size=512))
    assert nc["weight_decay"] == 0.05 and nc["gamma"] == lib.gamma_ == fitted["fitted"]["gamma_"]
    assert nc["temperature"] == pytest.approx(lib.temperature_, rel=1e-6)
    bad = nctv("run", "--weight-decay", "lots", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "Weight decay (λ) must be a number from 0 to 1,000,000, 'default', or one of " \
        "'auto', 'strong'; got 'lots'." in bad.stderr


def test_timing_takes_every_option(tmp_path):
    """Every option of `nctv timing`, each given a non-default value, reaches the run or the NC (FL) fit."""
    from nctv import data, zoo
    from nctv.calibration.clamping import NeuralClamping

    assert zoo.DEFAULT_MODEL != "fmnist-resnet"
    model = zoo.load_model("fmnist-resnet")
    out = tmp_path / "res"
    proc = nctv("timing", "--model", "fmnist-resnet", "--dataset", "fashion-mnist", "--calibration-seed", "3",
                "--calibration-size", "200", "--test-size", "150", "--device", "cpu", "--precision", "fp32",
                "--bins", "12", "--fitter", "toolkit", "--epochs", "1", "--gamma", "0.5", "--weight-decay", "0.05",
                "--temperature-rule", "selected", "--init", "data", "--lr", "0.02", "--batch-size", "64",
                "--resolutions", "0.1", "--out", str(out), "--no-cache", "--quiet", cwd=tmp_path)
    assert proc.stderr == "" and proc.stdout.startswith("timing: 4 methods") and str(out) in proc.stdout  # --quiet
    assert not (tmp_path / "cache").exists()  # --no-cache
    res = json.loads((out / "results.json").read_text())
    assert res["model"]["name"] == "fmnist-resnet" and res["calibration"]["name"] == "fashion-mnist calibration"
    cal, test = data.get_splits(model, calibration_size=200, calibration_seed=3, test_size=150)
    assert res["calibration"]["fingerprint"] == cal.fingerprint and res["test"]["fingerprint"] == test.fingerprint
    assert res["bins"] == [12] and res["fitter"] == "toolkit" and res["settings"]["resolutions"] == [0.1]
    assert list(res["methods"]) == ["Uncalibrated", "TS-Grid (0.1)", "NC (Eff.) (0.1)", "Neural Clamping (FL)"]
    s = res["settings"]
    assert (s["gamma"], s["epochs"], s["batch_size"], s["device"], s["precision"]["precision"]) == (
        0.5, 1, 64, "cpu", "fp32")
    given = {"gamma": 0.5, "fitter": "toolkit", "epochs": 1, "weight_decay": 0.05, "init": "data", "lr": 0.02,
             "temperature": "selected"}
    assert {k: s["nc"][k] for k in given} == given
    # The library fitted with these settings learns the same T: every Neural Clamping setting arrived.
    lib = NeuralClamping(model.model, gamma=0.5, fitter="toolkit", epochs=1, weight_decay=0.05, init="data",
                         lr=0.02, temperature="selected", seed=0, input_range=model.input_range,
                         progress=False).fit(cal.loader(batch_size=64))
    nc = res["methods"]["Neural Clamping (FL)"]["params"]
    assert nc["gamma"] == 0.5 and nc["weight_decay"] == 0.05
    assert nc["temperature"] == pytest.approx(lib.temperature_, rel=1e-6)
    assert nc["delta_l2"] == pytest.approx(float(lib.delta_.norm()), rel=1e-5)


@pytest.mark.filterwarnings("ignore:Neural Clamping. 300 calibration images")
def test_run_takes_the_temperature_rule(tmp_path, default_model):
    """--temperature-rule reaches the fast fitter: "selected" learns T with δ and re-chooses it, as the library does."""
    from nctv import data
    from nctv.calibration.clamping import NeuralClamping

    out = tmp_path / "res"
    nctv("run", "--seeds", "1", "--bins", "15", "--calibration-size", "300", "--test-size", "200", "--methods",
         "nc-fl", "--temperature-rule", "selected", "--out", str(out), "--quiet", cwd=tmp_path)
    res = json.loads((out / "results.json").read_text())
    nc = res["methods"]["Neural Clamping (FL)"]["params"]
    assert res["settings"]["nc"]["temperature"] == "selected"
    cal, _ = data.get_splits(default_model, calibration_size=300, test_size=200)
    lib = NeuralClamping(default_model.model, temperature="selected", seed=0, progress=False).fit(cal.loader(batch_size=512))
    anchored = NeuralClamping(default_model.model, seed=0, progress=False).fit(cal.loader(batch_size=512))
    assert nc["temperature"] == pytest.approx(lib.temperature_, rel=1e-6)
    assert nc["temperature"] != pytest.approx(anchored.temperature_, rel=1e-3)  # the rule changed the result
    bad = nctv("run", "--fitter", "toolkit", "--temperature-rule", "anchored", "--methods", "nc-fl", "--seeds", "1",
               "--calibration-size", "100", "--test-size", "100", "--quiet", cwd=tmp_path, check=False)
    assert bad.returncode != 0 and "anchored" in bad.stderr and "Traceback" not in bad.stderr


def test_a_bad_neural_clamping_setting_is_refused_before_the_model_runs(tmp_path):
    """`--gamma 50` is refused with the estimator's own message before any logits are computed, not
    after every baseline has run."""
    proc = nctv("run", "--gamma", "50", "--seeds", "1", "--calibration-size", "100", "--test-size", "100",
                "--out", str(tmp_path / "res"), cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("nctv run: error: Focal-loss gamma (γ) must be a number from 0 to 10 (the paper "
                                   "uses 0 to 5) or 'auto'; got '50'.")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "res").exists()  # no logits, no model pass


def test_a_bad_setting_is_refused_within_two_seconds_before_torch_loads(tmp_path):
    """The settings are checked right after parsing, before torch is imported: the refusal takes
    the time of Python's start, not of a model's."""
    code = ("import sys, time; t = time.perf_counter(); from nctv.cli import main; "
            "rc = main(['run', '--gamma', '50']); print(rc, 'torch' in sys.modules, time.perf_counter() - t)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), NCTV_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    rc, torch_loaded, seconds = proc.stdout.split()
    assert (rc, torch_loaded) == ("2", "False") and float(seconds) < 2.0
    assert "Focal-loss gamma (γ) must be a number from 0 to 10" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["ablation", "--lr", "11"], "The learning rate must be 'default' (the recipe's own: 0.001 for the paper, 0.01 for "
                                 "the toolkit) or a number above 0 and at most 10; got '11'."),
    (["timing", "--weight-decay", "1e7"], "Weight decay (λ) must be a number from 0 to 1,000,000, 'default', or one of "
                                          "'auto', 'strong'; got '1e7'."),
    (["sweep-gamma", "--fitter", "paper", "--epochs", "20000"], "epochs must be at most 10,000"),
    (["init-study", "--fitter", "toolkit", "--temperature-rule", "anchored"],
     "temperature='anchored' is a rule of the fast fitter; the 'toolkit' recipe learns T with δ"),
    (["run", "--gamma", "10.5", "--methods", "uncal"], "Focal-loss gamma (γ) must be a number from 0 to 10"),
    (["init-study", "--gamma", "lots"], "Focal-loss gamma (γ) must be a number from 0 to 10 (the paper uses 0 to 5) "
                                        "or 'auto'; got 'lots'."),
])
def test_every_neural_clamping_command_checks_its_settings_first(args, message, tmp_path, monkeypatch, capsys):
    from nctv.cli import main

    monkeypatch.setenv("NCTV_CACHE_DIR", str(tmp_path / "cache"))
    small = ["--calibration-size", "100", "--test-size", "100", "--out", str(tmp_path / "res"), "--quiet"]
    assert main([*args, *small]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nctv {args[0]}: error: ") and message in err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "res").exists()


@pytest.mark.parametrize("flag, field, text", [
    ("--weight-decay", "weight_decay", "lots"), ("--weight-decay", "weight_decay", "-0.1"),
    ("--weight-decay", "weight_decay", "2e6"), ("--lr", "lr", "0"), ("--lr", "lr", "11"), ("--lr", "lr", "fast"),
    ("--lr", "lr", "inf"), ("--gamma", "gamma", "10.5"),
])
def test_a_bad_setting_gets_one_message_in_the_app_and_the_command_line(flag, field, text, tmp_path, monkeypatch,
                                                                        capsys):
    """γ, λ and the learning rate are each read in one place: typed in the Calibrate tab's field or after the
    command line's flag, a bad value gets the same message, word for word."""
    import gradio as gr

    from nctv import zoo
    from nctv.cli import main
    from nctv.ui import calibrate as cal_tab
    from nctv.ui import limits

    monkeypatch.setenv("NCTV_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["run", flag, text, "--methods", "ts", "--out", str(tmp_path / "res"), "--quiet"]) == 2
    said = capsys.readouterr().err.strip()
    form = {"gamma": "1", "weight_decay": "default", "lr": "default", field: text}
    with pytest.raises(gr.Error) as shown:
        list(cal_tab.calibrate(zoo.DEFAULT_MODEL, "", limits.DEFAULT_DATASET_CHOICE, 300, 1000, 0, 15,
                               ["Temperature Scaling"], form["gamma"], form["weight_decay"], "random", "paper", 100,
                               form["lr"]))
    assert said == f"nctv run: error: {shown.value.message}"
    assert not (tmp_path / "cache").exists() and not (tmp_path / "res").exists()


@pytest.mark.parametrize("flag, field, text, value", [
    ("--weight-decay", "weight_decay", " Strong ", "strong"), ("--weight-decay", "weight_decay", "default", None),
    ("--weight-decay", "weight_decay", "0.02", 0.02), ("--lr", "lr", " 0.05 ", 0.05), ("--lr", "lr", "Default", None),
    ("--gamma", "gamma", " Auto ", "auto"),
])
def test_a_setting_typed_in_the_app_or_after_the_flag_is_the_same_value(flag, field, text, value):
    from nctv.cli import _nc_options
    from nctv.ui import calibrate as cal_tab

    typed = {"weight_decay": "default", "lr": "default", field: text}
    app = cal_tab.parse_nc_options("paper", typed["weight_decay"], 100, typed["lr"],
                                   **({"gamma": text} if field == "gamma" else {}))
    cli = _nc_options(build_parser().parse_args(["run", "--fitter", "paper", flag, text]))
    assert app.setting(field) == cli.setting(field) == value
    assert getattr(app, field) == getattr(cli, field) == text  # the fields keep what was typed


@pytest.mark.parametrize("args, message", [
    (["run", "--seeds", "99999999999999999999"], "argument --seeds: expected a whole number from 1 to 2,147,483,647"),
    (["run", "--batch-size", "0"], "argument --batch-size: expected a whole number from 1"),
    (["run", "--calibration-seed", "18446744073709551616"], "argument --calibration-seed: expected a whole number "
                                                            "from 0 to 4,294,967,295"),
    (["sweep-gamma", "--seed", "-1"], "argument --seed: expected a whole number from 0"),
    (["timing", "--resolutions", "1e-310"], "argument --resolutions: expected a grid step from 1e-06 to 1, got 1e-310"),
    (["timing", "--resolutions", "nan"], "argument --resolutions: expected a finite number, got 'nan'"),
    (["sweep-gamma", "--gammas", "0", "1e999"], "argument --gammas: expected a finite number, got '1e999'"),
    (["sweep-gamma", "--gammas", "11"], "argument --gammas: expected a gamma from 0 to 10, got 11"),
    (["run", "--coverage", "95"], "argument --coverage: expected a fraction between 0 and 1 (e.g. 0.95 for 95 %), got 95"),
    (["run", "--coverage", "1"], "argument --coverage: expected a fraction between 0 and 1"),
    (["run", "--coverage", "0"], "argument --coverage: expected a fraction between 0 and 1"),
    (["run", "--coverage", "nan"], "argument --coverage: expected a finite number, got 'nan'"),
    (["run", "--coverage", "０.９"], "argument --coverage: expected a number, got '０.９'"),
    (["run", "--conformal", "thr"], "argument --conformal: invalid choice: 'thr'"),
])
def test_numbers_beyond_range_are_refused_in_the_commands_words(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err and "Overflow" not in err


def test_run_makes_the_conformal_sets_asked_for(tmp_path, capsys):
    """`nctv run --conformal SCORE --coverage C` (here on a file of logits) scores every row with those sets:
    results.json, the printed table and table.md name them; `--conformal none` makes none; the score's
    names are the library's (nctv.conformal.SCORES), and a coverage with no sets is refused in words."""
    from nctv.cli import CONFORMAL_CHOICES, main
    from nctv.conformal import DEFAULT_COVERAGE, SCORES
    from tests.test_logits_file import _data, _write

    assert CONFORMAL_CHOICES == (*SCORES, "none")
    assert f"(default {DEFAULT_COVERAGE:g})" in " ".join(build_parser()._subparsers._group_actions[0].choices["run"]
                                                         .format_help().split())
    path = _write(tmp_path / "l.npz", *_data(n=600), cut=300)
    small = ["--methods", "uncal", "ts", "--seeds", "1", "--bins", "15", "--quiet"]
    for args, score, coverage in ((["--conformal", "RAPS", "--coverage", "0.8"], "raps", 0.8),
                                  (["--coverage", "0.95"], "lac", 0.95), ([], "lac", DEFAULT_COVERAGE)):
        out = tmp_path / f"{score}-{coverage}"
        assert main(["run", "--logits", str(path), *small, *args, "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        sets = [m["conformal"] for m in json.loads((out / "results.json").read_text())["methods"].values()]
        assert [(c["score"], c["coverage_target"]) for c in sets] == [(score, coverage)] * 2
        heading = f"Conformal prediction sets: {score.upper()} at {100 * coverage:g} % coverage"
        assert heading in printed and heading in (out / "table.md").read_text()
        assert heading.replace("%", r"\%") in (out / "table.tex").read_text()  # the LaTeX table's caption
        if score == "raps":  # the table names the λ and k_reg each row's sets used, tuned on a held-out part
            table = " ".join((out / "table.md").read_text().split())
            assert all(c["tuned"] == ["penalty", "k_reg"] and c["n_tune"] + c["n_conformal"] == 300 for c in sets)
            assert f"tuned on {sets[0]['n_tune']:,} calibration pictures" in table
            assert all(f"λ = {c['penalty']:g}, k_reg = {c['k_reg']}" in table for c in sets)
    out = tmp_path / "none"
    assert main(["run", "--logits", str(path), *small, "--conformal", "none", "--out", str(out)]) == 0
    assert "Conformal" not in capsys.readouterr().out and "Conformal" not in (out / "table.md").read_text()
    assert all(m["conformal"] is None for m in json.loads((out / "results.json").read_text())["methods"].values())
    assert main(["run", "--logits", str(path), *small, "--conformal", "none", "--coverage", "0.9",
                 "--out", str(tmp_path / "both")]) == 2
    assert capsys.readouterr().err.strip() == ("nctv run: error: --coverage is the coverage of the conformal sets, and "
                                               "--conformal none makes none: leave out one of the two.")
    assert not (tmp_path / "both").exists()


@pytest.mark.parametrize("score, percent, flags", [("aps", 95, ["--conformal", "aps", "--coverage", "0.95"]),
                                                   ("raps", 80, ["--conformal", "RAPS", "--coverage", "0.8"]),
                                                   ("lac", 90, [])])
def test_the_sets_chosen_in_the_app_and_after_the_flags_are_the_same_settings(score, percent, flags):
    """The Calibrate tab's score and coverage (per cent) and `nctv run --conformal --coverage` (a fraction) build
    equal ConformalSettings: the same q̂ to the last bit (the coverage 0.95 is the same float either way)."""
    from nctv.cli import _conformal_settings
    from nctv.ui import calibrate as cal_tab

    assert cal_tab.parse_conformal(score, percent) == _conformal_settings(build_parser().parse_args(["run", *flags]))


@pytest.mark.parametrize("score, coverage, words", [
    ("aps", 100, "Coverage must be a number from 50 to 99 (per cent); got 100."),
    ("aps", 0.95, "Coverage must be a number from 50 to 99 (per cent); got 0.95."),
    ("aps", float("nan"), "Coverage must be a number from 50 to 99 (per cent); got nan."),
    ("aps", [95], "Coverage must be a number from 50 to 99 (per cent); got [95]."),
    ("thr", 90, "Unknown conformal score 'thr'; use one of lac, aps, raps."),
])
def test_the_apps_handlers_refuse_bad_sets_in_words(score, coverage, words, tmp_path):
    """Called directly (as gradio_client's values reach them once the inputs have passed), both Calibrate
    handlers refuse a bad score or coverage in words, before anything runs."""
    import gradio as gr

    from nctv.ui import calibrate as cal_tab
    from tests.test_logits_file import _data, _write

    path = _write(tmp_path / "l.npz", *_data(n=100), cut=50)
    with pytest.raises(gr.Error) as shown:
        list(cal_tab.calibrate_logits(str(path), ["Temperature Scaling"], 15, 0, score, coverage))
    assert shown.value.message == words
    with pytest.raises(gr.Error) as shown:
        list(cal_tab.calibrate("fmnist-resnet-overconfident", "", "model's own dataset", 300, 1000, 0, 15,
                               ["Temperature Scaling"], "1", "default", "random", "fast", 100, "default", score,
                               coverage))
    assert shown.value.message == words
