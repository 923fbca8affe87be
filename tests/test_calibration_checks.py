"""The metrics and the test the field uses beside ECE: classwise ECE, the KS calibration error, the debiased
ℓ2 calibration error, NLL's calibration/refinement split, the calibration test, and honest intervals
at the boundary (population ECE 0 or near it). Every figure is checked against a hand computation, a
closed form, an independent implementation written from the paper's formula, or a simulation whose
population value is known."""
import math

import numpy as np
import pytest
import torch

import nctv.metrics as M
from bench.boundary import Case, coverage, draw, population_ece
from nctv import experiment, report
from nctv.consistency import consistency_test
from nctv.data import row_keys
from nctv.inference import model_logits
from nctv.intervals import Interval, at_boundary, interval, method_draws, resample_counts_for
from tests.test_experiment import CountingMatchedFilter, toy_split


def _softmax(z):
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _calibrated(n, k=10, scale=2.0, seed=0):
    """Gaussian logits and labels drawn from their softmax: calibrated exactly (numpy)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, k)) * scale
    y = (rng.random(n)[:, None] > _softmax(z).cumsum(1)).sum(1).clip(max=k - 1)
    return z, y


# ------------------------------------------------------------------ KS calibration error


def test_ks_error_by_hand():
    # Confidences 0.9, 0.6, 0.7 (predictions 0, 0, 1), right, right, wrong. Sorted by confidence the
    # residuals c − correct are −0.4 (0.6), +0.7 (0.7), −0.1 (0.9); partial sums −0.4, 0.3, 0.2.
    p = np.array([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7]])
    y = np.array([0, 0, 0])
    assert M.ks_error(p, y, from_probabilities=True) == pytest.approx(0.4 / 3, abs=1e-15)


def test_ks_error_equals_the_cumulative_formula_written_out():
    z, y = _calibrated(3000, seed=1)
    p = _softmax(z * 1.4)
    conf, pred = p.max(1), p.argmax(1)
    order = np.argsort(conf, kind="stable")
    walk = [0.0]
    for i in order:  # Gupta et al.: h̃_i − h_i, the cumulative confidence minus the cumulative accuracy
        walk.append(walk[-1] + conf[i] - float(pred[i] == y[i]))
    assert M.ks_error(z * 1.4, y) == pytest.approx(max(abs(v) for v in walk) / len(y), abs=1e-12)


# ------------------------------------------------------------------ debiased ℓ2 calibration error


def test_l2_error_by_hand():
    # Four samples, two equal-mass bins. Bin 1 (conf 0.6, 0.6; right, wrong): gap 0.1, ȳ = 0.5, noise
    # 0.25/1; bin 2 (0.8, 0.9; right, right): gap −0.15, ȳ = 1, noise 0. Square: ½(0.01 − 0.25) + ½·0.0225.
    p = np.array([[0.6, 0.4], [0.6, 0.4], [0.8, 0.2], [0.9, 0.1]])
    y = np.array([0, 1, 0, 0])
    assert M.l2_calibration_error(p, y, n_bins=2, from_probabilities=True) == 0.0  # the square is negative
    y = np.array([0, 0, 0, 0])  # bin 1: gap −0.4, ȳ = 1 → square ½·0.16 + ½·0.0225
    want = math.sqrt(0.5 * 0.16 + 0.5 * 0.0225)
    assert M.l2_calibration_error(p, y, n_bins=2, from_probabilities=True) == pytest.approx(want, abs=1e-15)


def test_l2_error_equals_kumar_liang_ma_written_out():
    z, y = _calibrated(2000, seed=2)
    p = _softmax(z / 0.8)
    conf, correct = p.max(1), (p.argmax(1) == y).astype(float)
    order = np.argsort(conf, kind="stable")
    square = 0.0
    for group in np.array_split(order, 15):
        ybar = correct[group].mean()
        square += len(group) / len(y) * ((conf[group].mean() - ybar) ** 2 - ybar * (1 - ybar) / (len(group) - 1))
    assert M.l2_calibration_error(z / 0.8, y) == pytest.approx(math.sqrt(max(square, 0)), abs=1e-12)


def test_the_l2_square_is_unbiased_where_the_plug_in_is_not():
    # Confidence 0.5 everywhere, right with probability 0.9: population ℓ2 error 0.4, so the square is 0.16.
    # 15 bins of 10 samples: the plug-in square reads 0.16 + 0.09/10 high; the debiased one reads 0.16.
    rng = np.random.default_rng(3)
    p = np.full((150, 2), 0.5)
    debiased, plug_in = [], []
    for _ in range(400):
        y = (rng.random(150) > 0.9).astype(int)  # label 0 (the prediction: ties go to index 0) w.p. 0.9
        debiased.append(M.l2_calibration_error(p, y, from_probabilities=True) ** 2)
        plug_in.append(np.mean((0.5 - (y == 0).reshape(15, 10).mean(1)) ** 2))
    se = np.std(debiased) / math.sqrt(len(debiased))
    assert abs(np.mean(debiased) - 0.16) < 3 * se
    assert np.mean(plug_in) - 0.16 == pytest.approx(0.009, abs=3 * se)


# ------------------------------------------------------------------ classwise ECE


def test_classwise_ece_is_kull_et_al_written_out_and_equals_sce():
    z, y = _calibrated(1500, k=4, seed=4)
    p = _softmax(z * 1.3)
    per_class = []
    for k in range(4):
        b = np.clip(np.ceil(p[:, k] * 15).astype(int) - 1, 0, 14)
        per_class.append(sum(abs(((y == k) - p[:, k])[b == m].sum()) for m in range(15)) / len(y))
    assert M.classwise_ece(z * 1.3, y) == pytest.approx(np.mean(per_class), abs=1e-12)
    assert M.classwise_ece(z * 1.3, y) == M.sce(z * 1.3, y)


# ------------------------------------------------------------------ NLL split


def test_nll_split_refinement_is_the_best_temperature_found_by_brute_force():
    z, y = _calibrated(2000, k=5, seed=5)
    over = z * 2.5  # over-confident: the best temperature is near 2.5
    split = M.nll_split(over, y)
    grid = np.exp(np.linspace(np.log(1.5), np.log(4.0), 2001))
    scaled = over[None, :, :] / grid[:, None, None]  # every temperature at once: (T, N, K)
    top = scaled.max(2, keepdims=True)
    log_norm = np.log(np.exp(scaled - top).sum(2)) + top[..., 0]
    nlls = (log_norm - scaled[:, np.arange(len(y)), y]).mean(1)
    assert split.refinement == pytest.approx(min(nlls), abs=1e-7)
    assert split.temperature == pytest.approx(grid[int(np.argmin(nlls))], rel=2e-3)
    assert split.nll == M.nll(over, y) and split.calibration + split.refinement == pytest.approx(split.nll, abs=1e-15)
    assert split.calibration > 0.05
    # Logits already at their best temperature have nothing left to re-calibrate.
    assert M.nll_split(over / split.temperature, y).calibration == pytest.approx(0.0, abs=1e-12)


def test_further_metrics_are_the_functions():
    z, y = _calibrated(800, seed=6)
    split = M.nll_split(z, y, 10)
    assert M.further(z, y, 10) == {"ks": M.ks_error(z, y), "l2_ce": M.l2_calibration_error(z, y, 10),
                                   "nll_calibration": split.calibration, "nll_refinement": split.refinement}


# ------------------------------------------------------------------ the calibration test


def test_the_test_statistics_are_ece_and_classwise_ece():
    z, y = _calibrated(1000, seed=7)
    t = consistency_test(z, y, 12, resamples=50)
    assert t.ece == pytest.approx(M.ece(z, y, 12), abs=1e-15)
    assert t.classwise_ece == pytest.approx(M.sce(z, y, 12), abs=1e-15)
    assert t.p_top_label >= 1 / 51 and t.p_classwise >= 1 / 51


def test_the_test_holds_its_size_under_the_null_and_rejects_a_tempered_model():
    # H₀ true: labels drawn from the model's own softmax. The p-value is exact, so it rejects at 5 % in
    # 5 % of test sets (binomial: 150 sets hold 1–15 rejections with probability > 0.99).
    p_null, p_cls = [], []
    for s in range(150):
        z, y = _calibrated(600, seed=100 + s)
        t = consistency_test(z, y, 15, resamples=100, seed=s)
        p_null.append(t.p_top_label)
        p_cls.append(t.p_classwise)
    assert 1 <= sum(p < 0.05 for p in p_null) <= 15
    assert 1 <= sum(p < 0.05 for p in p_cls) <= 15
    z, y = _calibrated(2000, seed=9)
    t = consistency_test(z * 1.3, y, 15, resamples=200)
    assert t.p_top_label < 0.01 and t.p_classwise < 0.01


def test_the_test_is_reproducible_and_explains_bad_input():
    z, y = _calibrated(500, seed=10)
    assert consistency_test(z, y, seed=3, resamples=100) == consistency_test(z, y, seed=3, resamples=100)
    with pytest.raises(ValueError, match="resamples"):
        consistency_test(z, y, resamples=0)
    with pytest.raises(ValueError, match="same shape"):
        consistency_test([z, z[:, :5]], y, resamples=10)


# ------------------------------------------------------------------ intervals at the boundary


def test_at_boundary_reaches_zero_only_where_the_test_does_not_reject():
    iv = Interval(0.012, 0.004, 0.02)
    assert at_boundary(iv, 0.3) == Interval(0.012, 0.0, 0.02)
    assert at_boundary(iv, 0.01) == iv
    assert at_boundary(iv, 0.07, level=0.9) == iv


def test_population_ece_of_the_simulation():
    # T = 1: calibrated, 0 exactly. T ≠ 1: the bins' gaps E[(q − c)·1[c ∈ b]] (q exact) from 400,000 draws,
    # against a second, independent Monte Carlo with labels drawn.
    assert population_ece(1.0, n=100_000) == 0.0
    exact = population_ece(1.05, n=400_000)
    z, y = draw(400_000, torch.Generator().manual_seed(99), 1.05)
    assert M.ece(z, y) == pytest.approx(exact, abs=0.0015)  # the plug-in's bias at this N is below 1e-3


@pytest.mark.parametrize("case, before_at_most", [(Case("calibrated", 1.0), 0.85), (Case("near", 1.02), None)])
def test_boundary_coverage_before_and_after(case, before_at_most):
    """A 95 % interval of ECE holds the population value at 0 and near it; the bootstrap alone held 0 in
    about two thirds. 100 test sets here (a coverage of 95 % reads 90 or more with probability 0.99); the
    full simulation, 200 sets of 5,000 against 92 %, is bench/results/boundary.md."""
    truth = population_ece(case.temperature, n=400_000)
    got = coverage(case, truth, sets=100, n=2000, resamples=300, seed=1)
    assert got["coverage_after"] >= 0.90
    if before_at_most is not None:
        assert got["coverage_before"] <= before_at_most


# ------------------------------------------------------------------ in a run, in its tables


def test_a_run_reports_the_test_and_says_consistent_with_calibrated(tmp_path):
    cal, test = toy_split(400, 1, "toy calibration"), toy_split(500, 2, "toy test")
    model = CountingMatchedFilter()
    r = experiment.run_experiment(model, cal, test, methods=["Uncalibrated", "Temperature Scaling"], seeds=1,
                                  bins=(15,), cache_dir=tmp_path, progress=False)
    x, y = test.tensors()
    z = model_logits(model, x)
    unc, ts = r.methods["Uncalibrated"].metrics[15], r.methods["Temperature Scaling"].metrics[15]
    key = row_keys(test)  # the run's: its resamples and tests follow the test pictures
    t_unc = consistency_test(z, y, 15, 1000, 0, key=key)
    t_ts = consistency_test(r.methods["Temperature Scaling"].test_logits, y, 15, 1000, 0, key=key)
    assert unc["calibration_p"].mean == t_unc.p_top_label and ts["calibration_p"].mean == t_ts.p_top_label
    assert ts["classwise_calibration_p"].mean == t_ts.p_classwise
    assert t_unc.p_top_label < 0.05 <= t_ts.p_top_label  # the matched filter is over-confident; TS fixes it
    for k, v in M.further(z, y, 15).items():
        assert unc[k].mean == pytest.approx(v, abs=1e-12)
    # TS's calibration errors reach 0; the uncalibrated row keeps its bootstrap interval.
    counts = resample_counts_for((key, y), 1000, 0)
    d = method_draws([z], y, counts, 15, ["ece"])["ece"]
    bootstrap = interval(d, "ece")
    assert (unc["ece"].ci_low, unc["ece"].ci_high) == pytest.approx((bootstrap.low, bootstrap.high), abs=1e-12)
    assert ts["ece"].ci_low == 0.0 and ts["ks"].ci_low == 0.0 and ts["ece"].ci_high > 0
    md = report.to_markdown(report.results_table(r, 15))
    ts_line = next(line for line in md.splitlines() if line.startswith("| Temperature Scaling"))
    unc_line = next(line for line in md.splitlines() if line.startswith("| Uncalibrated"))
    assert f"consistent with calibrated (p = {t_ts.p_top_label:.3f})" in ts_line
    assert "consistent" not in unc_line
    further = report.to_markdown(report.further_table(r, 15))
    assert "KS error (%)" in further and "NLL refinement" in further and f"{t_unc.p_top_label:.2g}" in further
    files = report.write_tables(r, tmp_path / "tables")
    assert (tmp_path / "tables" / "further.csv") in files
    assert "p (top-label calibrated)" in (tmp_path / "tables" / "further.csv").read_text()
