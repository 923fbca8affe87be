"""SMART, spline calibration and Top-versus-All. Known answers: hand-worked maps (bins, an isotonic pool, a
spline through a straight line, the top-label head's rescaling and its floor), the smooth soft ECE worked
out by hand, exact optimality of TS + TvA's temperature, fits that do not depend on the rows' order or the
thread count, crafted saved files refused, the authors' code where it is checked out beside NCTV
(``NCTV_CALIBENCH``, ``NCTV_TVA``, ``NCTV_SPLINE``: skipped where absent), and the bar of the margin
problem through ``nctv run --logits``."""
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import nctv.metrics as M
from nctv.calibration import METHODS, load_calibrator, make_method
from nctv.calibration.smart import GUARD, SMOOTHING, smooth_soft_ece
from nctv.calibration.toplabel import (LinearCurve, StepCurve, TopLabelHead, binary_cross_entropy_of_temperature,
                                       natural_spline_maps, spline_recalibration, top_label_data)
from tests.test_calibrators_beyond import _problem, _tamper

NEW = ("smart", "spline", "ts-tva", "vs-tva", "hb-tva", "iso-tva")
FAST_SMART = {"max_epochs": 150, "patience": 50}


def _logits_for(confidences):
    """Two-class logits whose top-label confidence is each of ``confidences`` (to float64 rounding)."""
    c = np.asarray(confidences, dtype=np.float64)
    return torch.from_numpy(np.stack([np.zeros_like(c), np.log(c / (1 - c))], axis=1))


def _fit(short, z, y, **settings):
    return make_method(short, **({**FAST_SMART, **settings} if short == "smart" else settings)).fit(z, y)


# ---- the top-label head -------------------------------------------------------------------------


def test_the_head_gives_the_top_class_its_new_confidence_and_the_others_their_proportions():
    z = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]], dtype=torch.float64)
    head = TopLabelHead(StepCurve(torch.tensor([0.0, 1.0]), torch.tensor([0.6])))
    p = torch.softmax(head(z).double(), dim=1)
    p0 = torch.softmax(z, dim=1)
    assert p[:, [0, 1]].tolist()[0][0] == pytest.approx(0.6, abs=1e-7) and p[1, 1] == pytest.approx(0.6, abs=1e-7)
    # The others share 0.4 as they shared 1 − c: row 0's classes 1 and 2 as e¹ : e⁰.
    assert float(p[0, 1] / p[0, 2]) == pytest.approx(math.e, rel=1e-6)
    assert float(p[1, 0] / p[1, 2]) == pytest.approx(float(p0[1, 0] / p0[1, 2]), rel=1e-6)
    assert torch.allclose(p.sum(1), torch.ones(2, dtype=torch.float64), atol=1e-6)


def test_the_head_keeps_the_prediction_where_the_map_would_drop_it_below_the_runner_up():
    # c = e²/(e² + e^1.9 + 1) ≈ 0.49; a map to 0.1 would leave the runner-up (share 0.9·e^1.9/(e^1.9 + 1) ≈ 0.78)
    # on top. The floor holds the top class where the two tie, p₂ / (1 − c + p₂) = sigmoid(1.9 − log(e^1.9 + 1)).
    z = torch.tensor([[1.9, 2.0, 0.0]], dtype=torch.float64)
    out = TopLabelHead(StepCurve(torch.tensor([0.0, 1.0]), torch.tensor([0.1])))(z)
    floor = 1 / (1 + math.exp(math.log(math.exp(1.9) + 1) - 1.9))
    p = torch.softmax(out.double(), dim=1)[0]
    assert int(out.argmax()) == 1 and float(p[1]) == pytest.approx(floor, rel=1e-6)
    assert float(out[0, 1]) > float(out[0, 0])  # ahead by one float32 step, not tied
    assert M.accuracy(out, torch.tensor([1])) == 1.0


def test_curves_interpolate_hold_and_bin_as_stated():
    lin = LinearCurve(torch.tensor([0.2, 0.4, 0.4, 0.8], dtype=torch.float64),
                      torch.tensor([0.1, 0.5, 0.5, 0.9], dtype=torch.float64))
    c = torch.tensor([0.0, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0], dtype=torch.float64)
    assert lin(c).tolist() == pytest.approx([0.1, 0.1, 0.3, 0.5, 0.7, 0.9, 0.9], abs=1e-15)
    edges = torch.tensor([0.0, 0.35, 0.65, 1.0], dtype=torch.float64)
    values = torch.tensor([0.5, 1 / 3, 2 / 3], dtype=torch.float64)
    x = torch.tensor([0.0, 0.35, 0.38, 0.65, 0.68, 1.0], dtype=torch.float64)
    assert StepCurve(edges, values, "below")(x).tolist() == pytest.approx([0.5, 0.5, 1 / 3, 1 / 3, 2 / 3, 2 / 3])
    assert StepCurve(edges, values, "above")(x).tolist() == pytest.approx([0.5, 1 / 3, 1 / 3, 2 / 3, 2 / 3, 2 / 3])


# ---- TvA: histogram binning and isotonic regression, worked by hand ----------------------------


def test_hb_tva_bins_the_top_label_confidence_by_hand():
    # Ten confidences 0.55 … 0.955 (K = 2: the top class's), three equal-mass bins: quantile edges at the
    # positions 3 and 6, the confidences 0.685 and 0.82 themselves; a confidence on an edge joins the bin below.
    c = 0.55 + 0.045 * np.arange(10)
    correct = np.array([0, 0, 1, 1, 0, 1, 0, 1, 1, 0], dtype=float)
    z = _logits_for(c)
    y = torch.from_numpy(np.where(correct == 1, 1, 0))
    hb = make_method("hb-tva", n_bins=3).fit(z, y)
    assert hb.bin_edges_.tolist() == pytest.approx([0.0, 0.685, 0.82, 1.0], abs=1e-12)
    assert hb.bin_values_.tolist() == pytest.approx([2 / 4, 1 / 3, 2 / 3], abs=1e-12)
    got = hb.calibrated_confidence(_logits_for([0.6, 0.7, 0.99])).tolist()
    assert got == pytest.approx([0.5, 1 / 3, 2 / 3], abs=1e-12)


def test_iso_tva_pools_violators():
    c = np.array([0.55, 0.6, 0.7, 0.8, 0.9])
    correct = np.array([1, 0, 0, 1, 1])  # the label is class 1, the top class, where the prediction is right
    iso = make_method("iso-tva").fit(_logits_for(c), torch.from_numpy(correct))
    # 0.55, 0.6, 0.7 pool to 1/3; 0.8 and 0.9 stay 1: knots at each run's ends.
    assert iso.thresholds_.tolist() == pytest.approx([0.55, 0.7, 0.8, 0.9], abs=1e-12)
    assert iso.values_.tolist() == pytest.approx([1 / 3, 1 / 3, 1.0, 1.0], abs=1e-12)
    assert iso.calibrated_confidence(_logits_for([0.75, 0.95])).tolist() == pytest.approx([2 / 3, 1.0], abs=1e-9)


# ---- spline calibration --------------------------------------------------------------------------


def test_natural_spline_maps_give_the_knot_values_at_the_knots_and_straight_lines_exactly():
    knots = np.linspace(0.0, 1.0, 6)
    value, slope = natural_spline_maps(knots, 6)
    assert np.abs(value - np.eye(6)).max() < 1e-12
    x = np.linspace(0.0, 1.0, 37)
    value, slope = natural_spline_maps(x, 6)
    line = 0.3 - 2.0 * knots  # a straight line is a natural spline: its value and slope everywhere
    assert np.abs(value @ line - (0.3 - 2.0 * x)).max() < 1e-12 and np.abs(slope @ line + 2.0).max() < 1e-12


def test_spline_recalibration_of_a_constant_offset_by_hand():
    # Targets s + 0.1: the cumulative difference is 0.1·i/n, a straight line in the position (i − 1)/(n − 1),
    # so the fit is exact and its slope is 0.1·(n − 1)/n: every confidence moves up by that.
    s = np.sort(np.random.default_rng(0).uniform(0.3, 0.8, 200))
    xs, values = spline_recalibration(s, s + 0.1, 6)
    assert np.array_equal(xs, s) and np.abs(values - (s + 0.1 * 199 / 200)).max() < 1e-12


def test_spline_ties_take_their_runs_mean_whatever_the_order():
    c = np.array([0.6, 0.6, 0.6, 0.7, 0.8, 0.8, 0.9])
    r = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    xs, values = spline_recalibration(c, r, 6)
    for order in ([1, 0, 2, 3, 5, 4, 6], [6, 5, 4, 3, 2, 1, 0]):
        assert np.array_equal(spline_recalibration(c[order], r[order], 6)[1], values)
    assert xs.tolist() == [0.6, 0.7, 0.8, 0.9]


# ---- SMART -----------------------------------------------------------------------------------------


def test_smooth_soft_ece_by_hand():
    # Every confidence 0.5, every prediction right: in each bin the mean confidence is 0.5 and the accuracy 1,
    # so each bin adds (√(0.25 + δ²) − δ) times its share of the rows' (normalised) weights.
    n = 40
    conf, acc = torch.full((n,), 0.5, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
    centres = (np.arange(15) + 0.5) / 15
    w = np.exp(-0.5 * (0.5 - centres) ** 2 / 0.05 ** 2)
    w = w / (w.sum() + GUARD)
    mass = n * w
    gap = (mass * 0.5 - mass * 1.0) / (mass + GUARD)
    expected = float(((np.sqrt(gap ** 2 + SMOOTHING ** 2) - SMOOTHING) * mass / (n + GUARD)).sum())
    assert float(smooth_soft_ece(conf, acc)) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.499, abs=1e-4)


def test_smart_keeps_predictions_and_its_temperatures_are_above_its_floor():
    z, y = _problem(5, n=800)
    smart = _fit("smart", z, y)
    out = smart.transform(z)
    assert torch.equal(out.argmax(1), z.argmax(1))
    ratio = (z / out.double())[:, 0]  # z / (z / T) = T per row
    assert float(ratio.min()) > 0.1 - 1e-6 and smart.n_epochs_ <= 150


def test_smart_depends_on_its_seed_only():
    z, y = _problem(4, n=500)
    a, b = _fit("smart", z, y), _fit("smart", z, y)
    assert torch.equal(a.network_, b.network_)
    assert not torch.equal(a.network_, _fit("smart", z, y, seed=1).network_)


@pytest.mark.parametrize("short", NEW)
def test_a_fit_does_not_depend_on_the_rows_order(short):
    z, y = _problem(4, n=700)
    perm = torch.randperm(700, generator=torch.Generator().manual_seed(3))
    a, b = _fit(short, z, y), _fit(short, z[perm], y[perm])
    assert torch.equal(a.transform(z), b.transform(z))


@pytest.mark.parametrize("short", ["smart", "vs-tva"])
def test_a_trained_fit_is_the_same_on_one_thread_and_on_several(short):
    z, y = _problem(4, n=700)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _fit(short, z, y).transform(z)
        torch.set_num_threads(max(2, os.cpu_count() or 2))
        several = _fit(short, z, y).transform(z)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, several)


# ---- TS + TvA: the exact minimiser -----------------------------------------------------------------


def test_ts_tva_temperature_minimises_the_top_label_binary_cross_entropy():
    z, y = _problem(6, n=1500)
    t = make_method("ts-tva").fit(z, y).temperature_
    correct = (z.argmax(1) == y).double()
    best = binary_cross_entropy_of_temperature(z, correct, t)
    for step in (1e-4, -1e-4, 1e-2, -1e-2):
        assert binary_cross_entropy_of_temperature(z, correct, t * math.exp(step)) >= best
    # …and it is the binary cross-entropy of the confidences max softmax(z / T), written out.
    c, r = top_label_data(z / t, y)
    assert best == pytest.approx(float(-(r * np.log(c) + (1 - r) * np.log1p(-c)).mean()), rel=1e-12)


# ---- saving --------------------------------------------------------------------------------------


def _saved(tmp_path, short, k=3):
    z, y = _problem(k, n=600)
    return _fit(short, z, y).save_pretrained(tmp_path / short)


@pytest.mark.parametrize("short", NEW)
def test_saved_and_loaded_gives_the_same_logits(tmp_path, short):
    z, y = _problem(3, n=600)
    cal = _fit(short, z, y)
    back = load_calibrator(cal.save_pretrained(tmp_path / short))
    assert type(back) is type(cal) and torch.equal(back.transform(z), cal.transform(z))


@pytest.mark.parametrize("short,fitted,tensors,message", [
    ("smart", None, {"network_": torch.zeros(5, dtype=torch.float64)}, r"network_ has shape \[5\]"),
    ("smart", {"gap_std_": -1.0}, None, r"gap_std_ is a spread"),
    ("smart", {"gap_mean_": "far"}, None, r"gap_mean_ must be a finite number"),
    ("smart", None, {"network_": torch.full((321,), math.nan, dtype=torch.float64)}, r"NaN or infinite"),
    ("spline", None, {"thresholds_": torch.tensor([0.5, 1.5], dtype=torch.float64),
                      "values_": torch.tensor([0.5, 0.6], dtype=torch.float64)}, r"non-decreasing confidences"),
    ("spline", None, {"values_": torch.tensor([0.5], dtype=torch.float64),
                      "thresholds_": torch.tensor([0.5], dtype=torch.float64)}, r"at least 2"),
    ("iso-tva", None, {"values_": torch.tensor([0.9, 0.1], dtype=torch.float64),
                       "thresholds_": torch.tensor([0.4, 0.6], dtype=torch.float64)}, r"must be non-decreasing"),
    ("hb-tva", None, {"bin_values_": torch.full((15,), 2.0, dtype=torch.float64)}, r"outside \[0, 1\]"),
    ("hb-tva", None, {"bin_edges_": torch.linspace(1, 0, 16, dtype=torch.float64)}, r"non-decreasing confidences"),
    ("vs-tva", None, {"scale_": torch.ones(4, dtype=torch.float64)}, r"scale_ has shape \[4\]"),
    ("ts-tva", {"temperature_": -2.0}, None, r"outside \[0.001, 1000\]"),
])
def test_crafted_files_are_refused(tmp_path, short, fitted, tensors, message):
    folder = _saved(tmp_path, short)
    assert type(load_calibrator(folder)).__name__ == METHODS[next(n for n, s in METHODS.items()
                                                                   if s.short == short)].cls
    _tamper(folder, fitted, tensors)
    with pytest.raises(ValueError, match=message):
        load_calibrator(folder)


@pytest.mark.parametrize("short,params,message", [
    ("smart", {"hidden_units": 0}, r"hidden_units must be"),
    ("hb-tva", {"on_edge": "sideways"}, r"on_edge must be one of 'below', 'above'"),
    ("spline", {"n_knots": 2}, r"n_knots must be"),
])
def test_crafted_settings_are_refused(tmp_path, short, params, message):
    folder = _saved(tmp_path, short)
    _tamper(folder, params=params)
    with pytest.raises(ValueError, match=message):
        load_calibrator(folder)


@pytest.mark.parametrize("short,settings,message", [
    ("smart", {"learning_rate": -1}, r"learning_rate must be"),
    ("smart", {"hidden_layers": 0}, r"hidden_layers must be"),
    ("vs-tva", {"epochs": 0}, r"epochs must be"),
    ("spline", {"n_knots": 1}, r"n_knots must be"),
    ("hb-tva", {"edges": "middle"}, r"edges must be one of"),
])
def test_bad_settings_are_refused_in_words(short, settings, message):
    z, y = _problem(3, n=100)
    with pytest.raises(ValueError, match=message):
        make_method(short, **settings).fit(z, y)


# ---- the authors' code, where it is checked out beside NCTV --------------------------------------


def _references():
    paths = {key: os.environ.get(f"NCTV_{key.upper()}") for key in ("calibench", "tva", "spline")}
    if not all(paths.values()):
        pytest.skip("the authors' repositories are not checked out (NCTV_CALIBENCH, NCTV_TVA, NCTV_SPLINE)")
    from bench import newest_parity as bench

    bench.REFS.update({k: Path(v) for k, v in paths.items()})
    return bench


def _small(bench, problem):
    zc, yc, zt, yt = bench.problems()[problem]
    return zc[:1500], yc[:1500], zt[:1500]


@pytest.mark.parametrize("problem", ["10 classes", "2 classes, rounded (ties)", "margin-dependent"])
def test_spline_equals_the_authors_spline_with_its_ties_and_interpolation(problem):
    bench = _references()
    zc, yc, zt = _small(bench, problem)
    ours = bench.ours_confidence("spline", zc, yc, zt)[0]
    assert np.abs(ours - bench.nctv_ties_in_authors_spline(zc, yc, zt)).max() < 1e-12
    if problem == "margin-dependent":  # no ties: the interpolation is the whole difference
        assert np.abs(ours - bench.gupta_spline_interpolated(zc, yc, zt)).max() < 1e-12
        assert np.abs(ours - bench.gupta_spline(zc, yc, zt)).max() > 1e-4


@pytest.mark.parametrize("problem", ["10 classes", "2 classes, rounded (ties)", "margin-dependent"])
def test_binning_and_isotonic_tva_equal_the_authors(problem):
    pytest.importorskip("netcal.binning")
    bench = _references()
    zc, yc, zt = _small(bench, problem)
    iso = bench.ours_confidence("iso-tva", zc, yc, zt)[0]
    assert np.abs(iso - bench.tva_binary("Iso_tva", zc, yc, zt)).max() < 1e-12
    # netcal fits its bins with a confidence on an edge in the bin above and applies them with it in the bin
    # below: NCTV's bins fitted so, applied so, are the reference's; with either rule alone they differ where
    # tied confidences sit on an edge.
    theirs = bench.tva_binary("HB_tva_eqmass", zc, yc, zt)
    assert np.abs(bench.hb_tva_as_netcal_applies_it(zc, yc, zt) - theirs).max() < 1e-12
    gap = np.abs(bench.ours_confidence("hb-tva", zc, yc, zt)[0] - theirs).max()
    assert gap > 1e-3 if problem.endswith("(ties)") else gap < 1e-12


def test_vs_tva_equals_the_authors_from_the_same_start():
    bench = _references()
    zc, yc, zt = _small(bench, "margin-dependent")
    mine, theirs = bench._vs_tva_pair(zc, yc, zt)
    assert np.abs(mine - theirs).max() < 1e-5


# ---- the bar: over-confidence that depends on the margin ------------------------------------------


def test_on_the_margin_problem_smart_splines_binning_and_isotonic_tva_beat_ts(tmp_path, capsys):
    from bench.newest_parity import margin_problem
    from nctv.cli import main

    z, y = margin_problem(4000, seed=7)
    path = tmp_path / "margin.npz"
    np.savez(path, calibration_logits=z[:2000].numpy(), calibration_labels=y[:2000].numpy(),
             test_logits=z[2000:].numpy(), test_labels=y[2000:].numpy())
    out = tmp_path / "out"
    assert main(["run", "--logits", str(path), "--methods", "ts", *NEW, "--bins", "15", "--seeds", "1",
                 "--conformal", "none", "--quiet", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["methods"]
    ece = {name: rows[name]["metrics"]["15"]["ece"]["mean"] for name in rows}
    ts = ece["Temperature Scaling"]
    for name in ("SMART", "Spline Calibration", "HB + TvA", "Isotonic + TvA"):
        assert ece[name] < ts, (name, ece)
    assert set(ece) == {"Temperature Scaling", *(s.name for s in METHODS.values() if s.short in NEW)}


# ---- everywhere a logit method goes: the shift study ---------------------------------------------


def test_the_shift_study_scores_the_newest_methods_under_corruption(default_model, tmp_path):
    from nctv.data import get_splits
    from nctv.experiment import run_experiment
    from nctv.shift import run_shift

    cal, test = get_splits(default_model, calibration_size=600, test_size=300)
    names = ["Temperature Scaling", "Spline Calibration", "HB + TvA"]
    result = run_shift(default_model, cal, test, ["contrast"], [3], names, cache_dir=tmp_path, progress=False,
                       intervals=None, examples=1)
    run = run_experiment(default_model, cal, test, names, seeds=1, bins=[15], cache_dir=False, progress=False,
                         intervals=None)
    for name in names:  # the clean row is the run's, and the corrupted one is a figure of its own
        assert result.value(name, "clean", "ece") == run.stats(name, "ece", 15).mean
        assert 0 <= result.value(name, "contrast/3", "ece") <= 1
