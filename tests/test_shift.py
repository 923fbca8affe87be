"""The shift study (nctv.shift.run_shift) on the embedded default model, on small splits: the
clean row is the clean run exactly, every condition's figures are the library's metrics of the
methods fitted once, the mean over corruptions is the mean, the paired differences are the
differences, each corrupted test split's logits are cached under a key of its own, a saved study
reads back whole and a crafted one is refused; `nctv shift` writes its table and figures."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from nctv import corruptions, experiment, metrics
from nctv.data import get_splits
from nctv.shift import AVERAGE, ShiftResult, comparison_table, run_shift, shift_table, summary_sentences

METHODS = ["Uncalibrated", "Temperature Scaling", "TS by Grid Search", "Neural Clamping (FL)"]
CORRUPTIONS = ["gaussian-noise", "contrast"]
SEVERITIES = [1, 4]


@pytest.fixture(scope="module")
def small(default_model):
    cal, test = get_splits(default_model, calibration_size=1600, test_size=800)
    return default_model, cal, test


@pytest.fixture(scope="module")
def study(small, tmp_path_factory):
    model, cal, test = small
    cache = tmp_path_factory.mktemp("cache")
    result = run_shift(model, cal, test, CORRUPTIONS, SEVERITIES, METHODS, cache_dir=cache,
                       progress=False, max_passes=6, intervals=experiment.IntervalSettings(resamples=200),
                       examples=3)
    return result, cache


def test_the_clean_row_is_the_clean_run_exactly(small, study):
    model, cal, test = small
    result, _ = study
    run = experiment.run_experiment(model, cal, test, METHODS, seeds=1, bins=[15], cache_dir=False, progress=False,
                                    max_passes=6, intervals=experiment.IntervalSettings(resamples=200))
    for m in METHODS:
        for metric in ("accuracy", "ece", "nll", "smooth_ece", "aece", "brier"):
            assert result.value(m, "clean", metric) == run.stats(m, metric, 15).mean
        f, s = result.figure(m, "clean", "ece"), run.stats(m, "ece", 15)
        assert (f["ci_low"], f["ci_high"]) == (s.ci_low, s.ci_high)
    # The paired differences too: the same pairs, widened alike where a row is consistent with calibrated.
    same = tested = 0
    for c in run.comparisons:
        if c.n_bins != 15 or c.metric not in ("ece", "accuracy"):
            continue
        ours = result.comparison(c.method, c.other, "clean", c.metric)
        if ours is not None:
            assert (ours.difference, ours.low, ours.high) == (c.difference, c.low, c.high)
            same += 1
            rows = [run.stats(m, "calibration_p", 15).mean for m in (c.method, c.other)]
            tested += c.metric == "ece" and max(rows) >= 0.05
    assert same >= 4 and tested >= 1


def test_each_condition_scores_the_methods_fitted_once_on_the_clean_split(small, study):
    model, cal, test = small
    result, _ = study
    assert result.conditions == ["clean", "gaussian-noise/1", "gaussian-noise/4", "contrast/1", "contrast/4"]
    # Refit the two temperature scalings and Neural Clamping by hand, score a corrupted split directly.
    from nctv.calibration import NeuralClamping, make_method
    from nctv.inference import model_logits

    xc, yc = cal.tensors()
    zc = model_logits(model.model, xc)
    bad = corruptions.corrupt_split(test, "contrast", 4, 0)
    xt, yt = bad.tensors()
    zt = model_logits(model.model, xt)
    ts = make_method("Temperature Scaling").fit(zc, yc)
    assert result.params["Temperature Scaling"]["temperature"] == pytest.approx(float(ts.temperature_), rel=1e-9)
    assert result.value("Temperature Scaling", "contrast/4") == pytest.approx(metrics.ece(ts.transform(zt), yt), abs=1e-12)
    assert result.value("Uncalibrated", "contrast/4", "accuracy") == pytest.approx(metrics.accuracy(zt, yt), abs=1e-12)
    torch.manual_seed(0)
    nc = NeuralClamping(model.model, gamma=1.0, max_passes=6, seed=0).fit(cal.loader(batch_size=512))
    assert result.value("Neural Clamping (FL)", "contrast/4") == pytest.approx(
        metrics.ece(nc.predict_logits(bad.loader(batch_size=512)), yt), abs=1e-6)
    # Every interval holds its debiased estimate's neighbourhood and lies within [0, 1].
    for m in METHODS:
        for key in result.conditions:
            f = result.figure(m, key, "ece")
            assert 0 <= f["ci_low"] <= f["ci_high"] <= 1


def test_the_mean_over_corruptions_and_the_paired_differences(study):
    result, _ = study
    for m in METHODS:
        for s in SEVERITIES:
            mean = np.mean([result.value(m, f"{c}/{s}") for c in CORRUPTIONS])
            assert result.value(m, f"{AVERAGE}/{s}") == pytest.approx(mean, abs=1e-15)
    nc, grid = "Neural Clamping (FL)", "TS by Grid Search"
    for key in result.conditions + [f"{AVERAGE}/4"]:
        c = result.comparison(nc, grid, key)
        assert c.difference == pytest.approx(result.value(nc, key) - result.value(grid, key), abs=0.01)
        assert c.low <= c.high
        mirror = result.comparison(grid, nc, key)
        assert (mirror.low, mirror.high) == (-c.high, -c.low)
    leaders = result.leaders("contrast/4")
    best = min(METHODS, key=lambda m: result.value(m, "contrast/4"))
    assert leaders[0] == best
    lines = summary_sentences(result)
    assert len(lines) == 2 and "lower in" in lines[0] and "tied in" in lines[0]


def test_each_corrupted_test_split_is_cached_under_its_own_key(small, study):
    model, cal, test = small
    result, cache = study
    files = list((cache / "logits").glob("*.safetensors"))
    assert len(files) == 2 + len(CORRUPTIONS) * len(SEVERITIES)  # calibration, clean test, each condition
    again = run_shift(model, cal, test, CORRUPTIONS, SEVERITIES, ["Uncalibrated", "Temperature Scaling"],
                      cache_dir=cache, progress=False, intervals=experiment.IntervalSettings(resamples=200))
    assert all(again.cache_hits.values())
    assert again.value("Temperature Scaling", "gaussian-noise/4") == result.value("Temperature Scaling", "gaussian-noise/4")


def test_tables_show_every_condition_with_intervals_and_a_fair_best(study):
    result, _ = study
    t = shift_table(result)
    assert t.rows[0] == "clean" and t.rows[-1] == "mean over corruptions, severity 4"
    assert len(t.rows) == 1 + 4 + 2
    for row, key in zip(t.cells, result.conditions):
        nc = row[1 + METHODS.index("Neural Clamping (FL)")]
        assert nc.mean == pytest.approx(100 * result.value("Neural Clamping (FL)", key))
        assert nc.low is not None and nc.low <= nc.high
        marked = {m for m, cell in zip(METHODS, row[1:]) if cell.rank == 1}
        assert marked == set(result.leaders(key))
    c = comparison_table(result)
    assert [cell.text for cell in c.cells[0][1::2]] == [result.comparison("Neural Clamping (FL)", r, "clean").verdict
                                                     for r in ("TS by Grid Search", "Temperature Scaling")]


def test_a_saved_study_reads_back_whole_and_a_crafted_one_is_refused(study, tmp_path):
    result, _ = study
    path = result.save(tmp_path)
    back = ShiftResult.load(tmp_path)
    assert back.to_dict() == json.loads(path.read_text())
    assert back.value("TS by Grid Search", "gaussian-noise/4") == result.value("TS by Grid Search", "gaussian-noise/4")
    assert len(back.examples["png"]["contrast/4"]) == 3
    data = json.loads(path.read_text())
    for breaks, message in [
        (lambda d: d.update(kind="run"), "not a saved shift study"),
        (lambda d: d["figures"]["Temperature Scaling"]["contrast/1"]["ece"].update(value="nan"), "not a finite number"),
        (lambda d: d["figures"]["Temperature Scaling"].pop("contrast/4"), "lacks the figures"),
        (lambda d: d["corruptions"].append("fog"), "unknown corruptions"),
        (lambda d: d.update(severities=[1, 9]), "from 1 to 5"),
        (lambda d: d["figures"]["Uncalibrated"]["clean"]["ece"].update(ci_low=0.5, ci_high=0.1), "malformed"),
        (lambda d: d.pop("methods"), "incomplete or malformed"),
    ]:
        crafted = json.loads(json.dumps(data))
        breaks(crafted)
        with pytest.raises(ValueError, match=message):
            ShiftResult.from_dict(crafted)


def test_a_bad_plan_is_refused_before_any_model_pass(small):
    model, cal, test = small
    x, y = test.tensors()
    with pytest.raises(ValueError, match="preprocessed tensors"):  # refused before the calibration pass
        run_shift(model, cal, (x, y), ["contrast"], [1], ["Temperature Scaling"], progress=False,
                  cache_dir=False)
    for kw, message in [({"corruptions": ["fog"]}, "Unknown corruption"), ({"severities": [0]}, "No severities"),
                        ({"severities": [7]}, "severity"), ({"calibrate_on": "contrast"}, "name/severity"),
                        ({"methods": ["Neural Clamping (FL)"], "gamma": 50}, "γ|gamma")]:
        with pytest.raises(ValueError, match=message):
            run_shift(model, cal, test, progress=False, cache_dir=False, **kw)


def test_calibrating_on_corrupted_images_fits_on_them(small):
    model, cal, test = small
    r = run_shift(model, cal, test, ["contrast"], [4], ["Temperature Scaling"], calibrate_on="contrast/4",
                  cache_dir=False, progress=False, intervals=experiment.IntervalSettings(resamples=100))
    clean = run_shift(model, cal, test, ["contrast"], [4], ["Temperature Scaling"], cache_dir=False,
                      progress=False, intervals=experiment.IntervalSettings(resamples=100))
    assert r.calibrate_on == "contrast/4" and "contrast" in r.calibration["name"]
    assert r.params["Temperature Scaling"]["temperature"] != clean.params["Temperature Scaling"]["temperature"]
    # Fitted for the conditions it is scored in, TS does at least as well there as the clean fit.
    assert r.value("Temperature Scaling", "contrast/4", "nll") <= clean.value("Temperature Scaling", "contrast/4", "nll")


@pytest.mark.slow
def test_the_command_writes_the_table_and_figures(tmp_path):
    out = tmp_path / "shift"
    proc = subprocess.run(
        [sys.executable, "-m", "nctv", "shift", "--corruptions", "contrast", "jpeg", "--severities", "2", "5",
         "--methods", "ts", "ts-grid", "nc-fl", "--calibration-size", "500", "--test-size", "600", "--resamples", "100",
         "--no-cache", "--quiet", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((out / "results.json").read_text())
    result = ShiftResult.from_dict(saved)
    table = (out / "table.md").read_text()
    v = result.value("TS by Grid Search", "jpeg/5")
    assert f"{100 * v:.2f}" in table and f"{100 * v:.2f}" in proc.stdout
    for name in ("shift.png", "shift.pdf", "shift.html", "shift-accuracy.png"):
        assert (out / "figures" / name).stat().st_size > 1000
    assert "Neural Clamping (FL) against TS by Grid Search" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "nctv", "shift", "--corruptions", "fog"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr and "Traceback" not in bad.stderr


def test_the_bench_counts_the_verdicts_it_reports(study):
    from bench import shift as bench_shift

    result, _ = study
    d = json.loads(json.dumps(bench_shift._compact(result)))
    summary = bench_shift.model_summary(d)
    for other in bench_shift.REFERENCES:
        verdicts = [result.comparison("Neural Clamping (FL)", other, k).verdict for k in result.conditions[1:]]
        assert [summary[other][v] for v in ("lower", "tied", "higher")] == [verdicts.count(v) for v in
                                                                            ("lower", "tied", "higher")]
    text = bench_shift.render({"command": "x", "started": "now", "minutes": 1.0, "commit": "abc", "machine": "m",
                               "models": ["toy"], "missing": {}, "studies": {"toy": d}})
    f = result.figure("TS by Grid Search", "contrast/4")
    assert f"{100 * f['value']:.2f} [{100 * f['ci_low']:.2f}, {100 * f['ci_high']:.2f}]" in text
