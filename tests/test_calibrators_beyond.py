"""The calibrators the field expects beyond the paper's: structured vector / matrix scaling, ensemble
temperature scaling, histogram binning and isotonic regression. Known answers: scikit-learn's
IsotonicRegression, the ensemble authors' formulas solved here with scipy as their code does, the
optimality conditions of the SVS / SMS objectives written here from the paper's formula, hand-worked
bins; every method of the registry on a binary problem; crafted saved files refused."""
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import nctv.metrics as M
from nctv.calibration import METHODS, load_calibrator, make_method
from nctv.calibration.nonparametric import PROBABILITY_FLOOR
from nctv.calibration.saving import CONFIG_NAME, TENSORS_NAME


def _problem(k, n=1500, seed=0, scale=3.0):
    """Over-confident logits: labels drawn from softmax(z / 2)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, k, generator=g, dtype=torch.float64) * scale
    y = torch.multinomial(torch.softmax(z / 2, dim=1), 1, generator=g).squeeze(1)
    return z, y


def _probs(cal, z):
    return torch.softmax(cal.transform(z).double(), dim=1).numpy()


# ---- isotonic regression: scikit-learn's, one-vs-rest, renormalised ----------------------------


@pytest.mark.parametrize("k", [2, 5])
def test_isotonic_equals_scikit_learn_one_vs_rest(k):
    from sklearn.isotonic import IsotonicRegression as Reference

    z, y = _problem(k)
    zt, _ = _problem(k, seed=1)
    p, pt = torch.softmax(z, 1).numpy(), torch.softmax(zt, 1).numpy()
    rows = [1] if k == 2 else range(k)
    ref = np.zeros_like(pt)
    for c in rows:
        ref[:, c] = Reference(out_of_bounds="clip").fit(p[:, c], (y.numpy() == c) * 1.0).predict(pt[:, c])
    if k == 2:
        ref[:, 0] = 1 - ref[:, 1]
    ref = np.maximum(ref, PROBABILITY_FLOOR)
    ref /= ref.sum(1, keepdims=True)
    ours = _probs(make_method("iso").fit(z, y), zt)
    assert np.abs(ours - ref).max() < 1e-7  # transform returns float32 log-probabilities


@pytest.mark.parametrize("name", ["10 classes", "7 classes, tied"])
def test_isotonic_equals_scikit_learn_with_near_scores_pooled(name):
    # The shipped model's 10-class probabilities hold many below 1e-15; the tied problem's rows repeat
    # with their values reordered, so softmax round-off leaves scores 1e-16 apart. scikit-learn pools
    # scores closer than 1e-15 (its _make_unique) and so does NCTV: the fits agree to round-off.
    from bench import calibrator_parity as bench

    zc, yc, zt, _ = bench.problems()[name if name == "10 classes" else f"drawn: {name}"]
    theirs = bench.sklearn_isotonic(zc, yc, zt)
    assert np.abs(bench.nctv_isotonic(zc, yc, zt) - theirs).max() < 1e-12


def test_isotonic_pools_scores_closer_than_float64_resolution():
    from nctv.calibration.nonparametric import isotonic_fit

    # Groups open at a score 1e-15 or more above the group's first: {1e-20, 5e-16, 9e-16}, {1.2e-15,
    # 2e-15, 2.1e-15} (2.1e-15 is within 1e-15 of 1.2e-15), {2.9e-15, 3.05e-15}, {0.3, 0.3 + 1e-16}.
    x = np.array([0.3, 1e-20, 5e-16, 2e-15, 0.3 + 1e-16, 9e-16, 1.2e-15, 2.1e-15, 2.9e-15, 3.05e-15])
    t = np.array([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    xs, fitted = isotonic_fit(x, t)
    assert xs.tolist() == [1e-20, 1.2e-15, 2.9e-15, 0.3]
    # Group means 1/3 (3 scores), 2/3 (3), 1/2 (2), 1/2 (2). Pool-adjacent-violators: 2/3 > 1/2 pools
    # to 3/5 (weight 5), then 3/5 > 1/2 pools to 4/7 (weight 7).
    assert fitted == pytest.approx([1 / 3, 4 / 7, 4 / 7, 4 / 7], abs=1e-15)
    from sklearn.isotonic import IsotonicRegression

    assert IsotonicRegression().fit(x, t).predict(xs) == pytest.approx(fitted, abs=1e-15)


def test_isotonic_pools_violators_and_ties():
    from nctv.calibration.nonparametric import isotonic_fit

    x = np.array([0.1, 0.2, 0.2, 0.3, 0.4, 0.5])
    t = np.array([0.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    xs, fitted = isotonic_fit(x, t)
    # 0.2 pools its two targets (0.5, weight 2); that violates 0.3's 0 → (0+1+0)/3 for 0.2 and 0.3.
    assert xs.tolist() == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert fitted == pytest.approx([0.0, 1 / 3, 1 / 3, 1.0, 1.0], abs=1e-15)


# ---- histogram binning: equal-mass bins, worked by hand -----------------------------------------


def test_histogram_binning_by_hand_on_a_binary_problem():
    # Positive-class probabilities 0.1, 0.2, …, 0.8 (logit difference log(p / (1 − p))); two
    # equal-mass bins: the median of the scores, 0.45, splits them; labels 0,1,0,0 | 1,1,0,1.
    p1 = np.arange(1, 9) / 10
    z = torch.from_numpy(np.stack([np.zeros(8), np.log(p1 / (1 - p1))], axis=1))
    y = torch.tensor([0, 1, 0, 0, 1, 1, 0, 1])
    hb = make_method("hb", n_bins=2).fit(z, y)
    assert hb.bin_edges_.tolist()[0] == pytest.approx([0.0, 0.45, 1.0], abs=1e-15)
    assert hb.bin_values_.tolist()[0] == pytest.approx([0.25, 0.75], abs=1e-15)
    q = _probs(hb, torch.tensor([[0.0, -5.0], [0.0, 0.0], [0.0, 5.0]], dtype=torch.float64))
    assert q[:, 1] == pytest.approx([0.25, 0.75, 0.75], abs=1e-7)  # float32 log-probabilities
    assert q.sum(1) == pytest.approx(1.0, abs=1e-7)


def test_histogram_binning_one_vs_rest_renormalises_and_floors_zeros():
    z, y = _problem(4, n=2000)
    hb = make_method("hb", n_bins=10).fit(z, y)
    p = torch.softmax(z, 1).numpy()
    # Each class's bins hold 200 samples each (equal mass), and its values are the label frequencies.
    for c in range(4):
        edges = hb.bin_edges_[c].numpy()
        idx = np.clip(np.searchsorted(edges, p[:, c], side="left") - 1, 0, 9)
        assert np.bincount(idx, minlength=10).tolist() == [200] * 10
        freq = np.bincount(idx, weights=(y.numpy() == c), minlength=10) / 200
        assert hb.bin_values_[c].numpy() == pytest.approx(freq, abs=1e-15)
    # A row every class of which falls in a bin of frequency 0 still gives finite log-probabilities.
    zero = torch.zeros(1, 4, dtype=torch.float64)
    hb.bin_values_ = torch.zeros_like(hb.bin_values_)
    out = hb.transform(zero)
    assert torch.isfinite(out).all() and torch.softmax(out.double(), 1).numpy() == pytest.approx(0.25)


def _binary_logits(p1):
    """Logits (0, log(p / (1 − p))): softmax gives back p as the positive class's probability."""
    p1 = np.asarray(p1, dtype=np.float64)
    return torch.from_numpy(np.stack([np.zeros_like(p1), np.log(p1 / (1 - p1))], axis=1))


def test_histogram_binning_conventions_by_hand():
    # Ten positive-class scores 0.05, 0.15, …, 0.95 and three bins. Quantile edges at positions
    # 9·1/3 = 3 and 9·2/3 = 6 are the scores 0.35 and 0.65 themselves; runs of sorted scores
    # (np.array_split: 4, 3, 3) put the midpoint edges at (0.35 + 0.45)/2 = 0.4 and (0.65 + 0.75)/2 = 0.7.
    z = _binary_logits(np.arange(10) / 10 + 0.05)
    y = torch.tensor([0, 0, 1, 1, 0, 1, 0, 1, 1, 0])
    # Scored: the calibration score 0.35 itself (its logits, so the same float), 0.38 and 0.68.
    zt = torch.cat([z[3:4], _binary_logits([0.38, 0.68])])
    cases = {
        # quantile edges, a score on an edge in the bin below: {.05–.35} {.45–.65} {.75–.95}
        ("quantile", "below"): ([0, 0.35, 0.65, 1], [2 / 4, 1 / 3, 2 / 3], [2 / 4, 1 / 3, 2 / 3]),
        # … in the bin above: {.05–.25} {.35–.55} {.65–.95}
        ("quantile", "above"): ([0, 0.35, 0.65, 1], [1 / 3, 2 / 3, 2 / 4], [2 / 3, 2 / 3, 2 / 4]),
        # midpoint edges: the same samples as the first, but 0.38 and 0.68 fall one bin lower
        ("midpoint", "below"): ([0, 0.4, 0.7, 1], [2 / 4, 1 / 3, 2 / 3], [2 / 4, 2 / 4, 1 / 3]),
    }
    for (edges, on_edge), (want_edges, want_values, want_scored) in cases.items():
        hb = make_method("hb", n_bins=3, edges=edges, on_edge=on_edge).fit(z, y)
        assert hb.bin_edges_[0].tolist() == pytest.approx(want_edges, abs=1e-15), (edges, on_edge)
        assert hb.bin_values_[0].tolist() == pytest.approx(want_values, abs=1e-15), (edges, on_edge)
        assert _probs(hb, zt)[:, 1] == pytest.approx(want_scored, abs=1e-7), (edges, on_edge)


def test_histogram_binning_midpoint_edges_with_fewer_scores_than_bins():
    # Three scores, five bins: one run a score, edges halfway between them, the two left over at 1
    # (empty bins of width 0, valued at their midpoint, 1); a score of 1 still joins the third bin.
    z = _binary_logits([0.2, 0.4, 0.8])
    hb = make_method("hb", n_bins=5, edges="midpoint").fit(z, torch.tensor([0, 1, 1]))
    assert hb.bin_edges_[0].tolist() == pytest.approx([0, 0.3, 0.6, 1, 1, 1], abs=1e-15)
    assert hb.bin_values_[0].tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]
    above = make_method("hb", n_bins=5, edges="midpoint", on_edge="above").fit(z, torch.tensor([0, 1, 0]))
    assert above.bin_values_[0].tolist() == [0.0, 1.0, 0.0, 1.0, 1.0]
    # Above, a score of 1 sits on the edges 1 = 1 = 1: the last bin, [1, 1] (empty: its midpoint, 1);
    # below, it joins (0.6, 1], as 0.7 does in both.
    scored = torch.cat([torch.tensor([[-40.0, 40.0]], dtype=torch.float64), _binary_logits([0.7])])
    assert _probs(above, scored)[:, 1] == pytest.approx([1.0, 0.0], abs=1e-7)
    below = make_method("hb", n_bins=5, edges="midpoint").fit(z, torch.tensor([0, 1, 0]))
    assert _probs(below, scored)[:, 1] == pytest.approx([0.0, 0.0], abs=1e-7)


@pytest.mark.parametrize("setting,value,message", [
    ("on_edge", "middle", r"on_edge must be one of 'below', 'above'; got 'middle'"),
    ("edges", "equal", r"edges must be one of 'quantile', 'midpoint'; got 'equal'"),
    ("edges", None, r"edges must be one of 'quantile', 'midpoint'; got None"),
])
def test_histogram_binning_refuses_unknown_conventions(setting, value, message):
    z, y = _problem(2, n=100)
    with pytest.raises(ValueError, match=message):
        make_method("hb", **{setting: value}).fit(z, y)


def test_histogram_binning_conventions_are_saved_and_loaded(tmp_path):
    z = _binary_logits(np.arange(10) / 10 + 0.05)
    y = torch.tensor([0, 0, 1, 1, 0, 1, 0, 1, 1, 0])
    hb = make_method("hb", n_bins=3, edges="midpoint", on_edge="above").fit(z, y)
    loaded = load_calibrator(hb.save_pretrained(tmp_path / "hb"))
    assert (loaded.edges, loaded.on_edge) == ("midpoint", "above")
    assert torch.equal(loaded.transform(z[3:4]), hb.transform(z[3:4]))  # a score on an edge: above
    # A file written before the settings existed holds neither: it loads with the defaults it was fitted by.
    old = make_method("hb", n_bins=3).fit(z, y).save_pretrained(tmp_path / "old")
    config = json.loads((old / CONFIG_NAME).read_text())
    del config["params"]["edges"], config["params"]["on_edge"]
    (old / CONFIG_NAME).write_text(json.dumps(config))
    assert (load_calibrator(old).edges, load_calibrator(old).on_edge) == ("quantile", "below")


def _tie_problem(k, step, seed):
    """Logits rounded to multiples of ``step``: many calibration scores tie, on the edges too."""
    z, y = _problem(k, n=1200, seed=seed, scale=2.0)
    return torch.round(z / step) * step, y


_NETCAL, _KUMAR = {"on_edge": "above"}, {"edges": "midpoint"}


@pytest.mark.parametrize("reference,settings,problem,other", [
    # other: NCTV's settings with one convention changed, which must differ from the reference there
    ("netcal", _NETCAL, "2 classes", {"on_edge": "below"}),
    ("netcal", _NETCAL, "10 classes, z / 4", None),
    ("netcal", _NETCAL, "ties, 4 classes", {"on_edge": "below"}),
    ("netcal", _NETCAL, "ties, 2 classes", {"on_edge": "below"}),
    ("uncertainty-calibration", _KUMAR, "10 classes", {"edges": "quantile"}),
    ("uncertainty-calibration", _KUMAR, "2 classes", {"edges": "quantile"}),
    ("uncertainty-calibration", _KUMAR, "ties, 4 classes", {"edges": "midpoint", "on_edge": "above"}),
    ("uncertainty-calibration", _KUMAR, "ties, 2 classes", {"edges": "midpoint", "on_edge": "above"}),
])
def test_histogram_binning_equals_its_references(reference, settings, problem, other):
    """Where the bench-only references are installed (bench/calibrator_parity.py says how): each equals
    NCTV with the settings of its conventions, and differs from NCTV with either convention changed."""
    pytest.importorskip({"netcal": "netcal.binning", "uncertainty-calibration": "calibration.calibrators"}[reference],
                        reason=f"{reference} is bench-only")
    from bench import calibrator_parity as bench

    if problem.startswith("ties"):
        k, step = (4, 1.0) if problem == "ties, 4 classes" else (2, 0.5)
        (zc, yc), (zt, _) = _tie_problem(k, step, 0), _tie_problem(k, step, 1)
        zc, yc, zt = zc.numpy(), yc.numpy(), zt.numpy()
    else:
        zc, yc, zt, _ = bench.problems()[problem]
    theirs = (bench.netcal_binning if reference == "netcal" else bench.kumar_binning)(zc, yc, zt)
    mine, _ = bench.ours("Histogram Binning", zc, yc, zt, **settings)
    assert np.abs(mine - theirs).max() < 1e-7  # float32 log-probabilities
    if other is not None:
        mine, _ = bench.ours("Histogram Binning", zc, yc, zt, **other)
        assert np.abs(mine - theirs).max() > 1e-3


# ---- ensemble temperature scaling: the authors' formulas ----------------------------------------


def _authors_ets(z, y, k):
    """Their procedure, written here from their published formulas: T by MSE on [0.05, 5] from T = 1
    with L-BFGS-B, then w on the simplex by SLSQP from (1, 0, 0), both to tol 1e-12."""
    from scipy import optimize

    onehot = np.eye(k)[y]

    def sm(a):
        e = np.exp(a - a.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)

    t = optimize.minimize(lambda t: np.mean((sm(z / t[0]) - onehot) ** 2), 1.0, method="L-BFGS-B",
                          bounds=((0.05, 5.0),), tol=1e-12).x[0]
    parts = (sm(z / t), sm(z), np.full_like(z, 1 / k))

    def mse(w):
        p = sum(wi * pi for wi, pi in zip(w, parts))
        return np.mean((p / p.sum(1, keepdims=True) - onehot) ** 2)

    w = optimize.minimize(mse, (1.0, 0.0, 0.0), method="SLSQP", bounds=((0, 1),) * 3, tol=1e-12,
                          constraints={"type": "eq", "fun": lambda w: np.sum(w) - 1}).x
    return t, w


@pytest.mark.parametrize("k", [2, 6])
def test_ensemble_temperature_scaling_equals_the_authors_formulas(k):
    z, y = _problem(k)
    zt, _ = _problem(k, seed=1)
    t, w = _authors_ets(z.numpy(), y.numpy(), k)
    ets = make_method("ets").fit(z, y)
    assert ets.temperature_ == pytest.approx(t, rel=1e-5)
    assert ets.weights_.numpy() == pytest.approx(w, abs=1e-5)
    e = np.exp(zt.numpy() - zt.numpy().max(1, keepdims=True))
    s = lambda a: np.exp(a - a.max(1, keepdims=True)) / np.exp(a - a.max(1, keepdims=True)).sum(1, keepdims=True)
    ref = w[0] * s(zt.numpy() / t) + w[1] * e / e.sum(1, keepdims=True) + w[2] / k
    assert np.abs(_probs(ets, zt) - ref).max() < 1e-5


def test_ensemble_weights_solve_the_simplex_problem_exactly():
    from nctv.calibration.structured import simplex_least_squares

    rng = np.random.default_rng(3)
    for _ in range(20):
        b_ = rng.normal(size=(5, 3))
        a, b = b_.T @ b_, rng.normal(size=3)
        w = simplex_least_squares(a, b)
        grid = [np.array([i, j, 200 - i - j]) / 200 for i in range(201) for j in range(201 - i)]
        best = min(g @ a @ g - 2 * b @ g for g in grid)
        assert w.min() >= 0 and w.sum() == pytest.approx(1) and w @ a @ w - 2 * b @ w <= best + 1e-12


# ---- SVS and SMS: the optimum of the paper's objective ------------------------------------------


@pytest.mark.parametrize("name,k", [("svs", 4), ("sms", 4), ("sms", 2)])
def test_structured_scaling_is_the_optimum_of_its_objective(name, k):
    """The gradient of the objective, written here from the formula and differentiated by autograd,
    vanishes at the fitted parameters; a far larger penalty pins the map to the identity."""
    from nctv.calibration.temperature import fit_nll_temperature

    z, y = _problem(k, n=800)
    cal = make_method(name).fit(z, y)
    n = len(y)
    t = fit_nll_temperature(z, y)
    eps = 1 / (n + 1)
    assert cal.temperature_ == pytest.approx(t, rel=1e-12) and cal.uniform_weight_ == eps
    x = torch.log((1 - eps) * torch.softmax(z / t, 1) + eps / k)
    b = cal.bias_.clone().requires_grad_(True)
    if name == "svs":
        v = cal.scale_.clone().requires_grad_(True)
        loss = torch.nn.functional.cross_entropy(x * v + b, y) + k / n * ((b ** 2).sum() + ((v - 1) ** 2).sum())
        params = (v, b)
    else:
        w = cal.weight_.clone().requires_grad_(True)
        d = w - torch.eye(k, dtype=torch.float64)
        off = ~torch.eye(k, dtype=torch.bool)
        loss = (torch.nn.functional.cross_entropy(x @ w.T + b, y) + k / n * ((b ** 2).sum() + (d.diagonal() ** 2).sum())
                + k * (k - 1) / n * (d[off] ** 2).sum())
        params = (w, b)
    grads = torch.autograd.grad(loss, params)
    assert max(float(g.abs().max()) for g in grads) < 1e-8
    assert torch.allclose(cal.transform(z).double(), (x * cal.scale_ + cal.bias_ if name == "svs"
                                                      else x @ cal.weight_.T + cal.bias_).float().double())
    pinned = make_method(name, lambda_intercept=1e9, lambda_diagonal=1e9,
                         **({} if name == "svs" else {"lambda_off_diagonal": 1e9})).fit(z, y)
    assert torch.allclose(pinned.transform(z).double(), x, atol=1e-6)


# ---- every method of the registry on a binary problem ------------------------------------------


@pytest.mark.parametrize("name", [n for n, s in METHODS.items() if not s.needs_model])
def test_every_logit_method_calibrates_a_binary_problem(name):
    z, y = _problem(2, n=1200)
    zt, yt = _problem(2, n=1200, seed=1)
    cal = METHODS[name].factory().fit(z, y)
    out = cal.transform(zt)
    assert out.shape == (1200, 2) and torch.isfinite(out).all()
    if name != "Uncalibrated":  # over-confident by a factor 2: every method lowers the NLL
        assert M.nll(out, yt) < M.nll(zt, yt)


# ---- saved files: what a crafted one holds is refused ------------------------------------------


def _saved(tmp_path, name, k=3):
    z, y = _problem(k, n=600)
    return make_method(name).fit(z, y).save_pretrained(tmp_path / name)


def _tamper(folder, fitted=None, tensors=None, params=None):
    config = json.loads((folder / CONFIG_NAME).read_text())
    config["fitted"].update(fitted or {})
    config["params"].update(params or {})
    (folder / CONFIG_NAME).write_text(json.dumps(config))
    if tensors:
        stored = load_file(folder / TENSORS_NAME)
        stored.update({f"fitted.{k}": v for k, v in tensors.items()})
        save_file(stored, folder / TENSORS_NAME)


@pytest.mark.parametrize("name,fitted,tensors,message", [
    ("hb", None, {"bin_values_": torch.full((3, 15), 1.5, dtype=torch.float64)}, r"bin_values_ holds values outside"),
    ("hb", None, {"bin_edges_": torch.linspace(1, 0, 16, dtype=torch.float64).repeat(3, 1)},
     r"bin_edges_ must be non-decreasing"),
    ("hb", None, {"bin_values_": torch.zeros(3, 14, dtype=torch.float64)}, r"bin_values_ has shape \[3, 14\]"),
    ("hb", {"n_classes_": "three"}, None, r"n_classes_ must be a whole number"),
    ("iso", None, {"values_": torch.full((3, 2), math.nan, dtype=torch.float64)}, r"has shape|NaN or infinite"),
    ("iso", {"n_classes_": 2}, None, r"thresholds_ has shape"),
    ("ets", None, {"weights_": torch.tensor([0.9, 0.9, -0.8], dtype=torch.float64)}, r"must be >= 0 and sum to 1"),
    ("ets", {"temperature_": 50.0}, None, r"outside \[0.05, 5\]"),
    ("svs", {"uniform_weight_": 2.0}, None, r"uniform_weight_ must lie strictly between 0 and 1"),
    ("svs", None, {"scale_": torch.ones(4, dtype=torch.float64)}, r"scale_ has shape \[4\]"),
    ("sms", None, {"weight_": torch.full((3, 3), math.inf, dtype=torch.float64)}, r"NaN or infinite"),
])
def test_crafted_files_are_refused(tmp_path, name, fitted, tensors, message):
    folder = _saved(tmp_path, name)
    spec = next(s for s in METHODS.values() if s.short == name)
    assert type(load_calibrator(folder)).__name__ == spec.cls  # the file as saved loads
    _tamper(folder, fitted, tensors)
    with pytest.raises(ValueError, match=message):
        load_calibrator(folder)


@pytest.mark.parametrize("params,message", [
    ({"on_edge": "sideways"}, r"The calibrator's on_edge must be one of 'below', 'above'; got 'sideways'"),
    ({"edges": 7}, r"The calibrator's edges must be one of 'quantile', 'midpoint'; got 7"),
])
def test_crafted_histogram_binning_settings_are_refused(tmp_path, params, message):
    folder = _saved(tmp_path, "hb")
    _tamper(folder, params=params)
    with pytest.raises(ValueError, match=message):
        load_calibrator(folder)


def test_a_calibrator_for_other_classes_is_refused_for_a_model(tmp_path, default_model):
    folder = _saved(tmp_path, "hb", k=3)
    with pytest.raises(ValueError, match=r"fitted for 3 classes; the model given has 10"):
        load_calibrator(folder, model=default_model)


def test_the_command_line_help_lists_every_short_name():
    from nctv.cli import EPILOG

    line = EPILOG.split("method names for --methods (full names or short ones):\n")[1].splitlines()[0]
    assert [n.strip() for n in line.split(",")] == [s.short for s in METHODS.values()]
