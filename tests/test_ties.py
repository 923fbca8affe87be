"""Every figure is a function of the rows, not of their order: the same rows shuffled give the same
metrics, intervals, calibration test and calibrator fits, to the last bit, on data full of ties.

The tied problems (bench.parity_problems.pooled) draw every row from a few dozen distinct rounded rows,
half of them the others with their values reordered: confidences tie in long runs of right and wrong
answers, and some probabilities lie one unit in the last place apart. The rounded ones are a model's
logits written with one decimal. Beside the shuffles, small cases whose answers are worked out by hand
pin the rules for ties: equal confidences share an equal-mass bin, and the KS error steps once per
distinct confidence.
"""
import numpy as np
import pytest
import torch

import nctv.metrics as M
from bench.parity_problems import pooled, synthetic
from nctv.calibration import METHODS, make_method
from nctv.consistency import consistency_test
from nctv.intervals import RESAMPLED, method_draws, resample_counts

PROBLEMS = {
    "7 classes, tied": lambda: pooled(7, 1500, 3),
    "20 classes, tied": lambda: pooled(20, 1500, 4),
    "7 classes, rounded": lambda: synthetic(7, 1500, 5, decimals=1),
    "20 classes, rounded": lambda: synthetic(20, 1500, 6, decimals=1),
}
SHUFFLES = (1, 2, 3)


@pytest.fixture(scope="module", params=list(PROBLEMS))
def problem(request):
    return PROBLEMS[request.param]()


def shuffled(seed, *arrays):
    perm = np.random.default_rng(seed).permutation(len(arrays[0]))
    return perm, [a[perm] for a in arrays]


def same(a, b):
    """Equal to the last bit (NaN equal to NaN), for numbers, arrays and dataclasses of them."""
    if hasattr(a, "__dataclass_fields__"):
        return all(same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        a, b = a.numpy(), b.numpy()
    return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


def every_metric(z, y):
    return {
        "evaluate": M.evaluate(z, y),
        "evaluate, 10 bins": M.evaluate(z, y, n_bins=10),
        "further": M.further(z, y),
        "further, 7 bins": M.further(z, y, n_bins=7),
        "reliability": M.reliability_bins(z, y),
        "smooth": M.smooth_reliability(z, y),
        "split": M.nll_split(z, y),
        "entropy": M.entropy(z),
        "classwise": M.classwise_ece(z, y),
        "float32": M.evaluate(z.astype(np.float32), y),
    }


def test_every_metric_ignores_the_order_of_the_rows(problem):
    z, y = problem
    reference = every_metric(z, y)
    for seed in SHUFFLES:
        _, (zs, ys) = shuffled(seed, z, y)
        again = every_metric(zs, ys)
        moved = [name for name in reference if not same(reference[name], again[name])]
        assert not moved, f"shuffle {seed} moved {moved}"


def test_metrics_of_probabilities_ignore_the_order_too(problem):
    z, y = problem
    p = torch.softmax(torch.from_numpy(z), 1).numpy()
    reference = {"evaluate": M.evaluate(p, y, from_probabilities=True),
                 "further": M.further(p, y, from_probabilities=True)}
    _, (ps, ys) = shuffled(1, p, y)
    assert same(reference, {"evaluate": M.evaluate(ps, ys, from_probabilities=True),
                            "further": M.further(ps, ys, from_probabilities=True)})


def test_smooth_ece_batches_ignore_the_order_of_samples_and_of_resamples_copies(problem):
    z, y = problem
    conf, pred = M.confidences_and_predictions(z)
    correct = (pred == y).astype(float)
    counts = resample_counts(len(y), 100, 0)
    value, sigma = M.smooth_ece_batch(conf, correct, counts=counts)
    perm, (cs, ks) = shuffled(1, conf, correct)
    again, sigma_again = M.smooth_ece_batch(cs, ks, counts=counts[:, perm])
    assert same(value, again) and same(sigma, sigma_again)
    rows = np.stack([conf, conf[::-1]]), np.stack([correct, correct[::-1]])
    assert same(M.smooth_ece_batch(*rows)[0], M.smooth_ece_batch(rows[0][:, perm], rows[1][:, perm])[0])


def test_intervals_ignore_the_order_of_the_rows(problem):
    """A resample is a multiset of rows: drawing the same rows the same number of times, in any order,
    gives the same draws of every metric."""
    z, y = problem
    counts = resample_counts(len(y), 100, 7)
    metrics = list(RESAMPLED)
    reference = method_draws([z], y, counts, 15, metrics)
    for seed in SHUFFLES[:2]:
        perm, (zs, ys) = shuffled(seed, z, y)
        again = method_draws([zs], ys, counts[:, perm], 15, metrics)
        moved = [m for m in metrics if not same(reference[m], again[m])]
        assert not moved, f"shuffle {seed} moved {moved}"


def test_intervals_of_duplicated_rows_ignore_which_copy_is_drawn():
    """Identical rows are one sample drawn several times: handing their counts to the copies in
    another order changes no draw."""
    z, y = pooled(7, 600, 9, rows=6)
    counts = resample_counts(len(y), 100, 3)
    twin = np.flatnonzero((z == z[0]).all(1) & (y == y[0]))
    assert len(twin) > 2
    swapped = counts.clone()
    swapped[:, twin] = counts[:, np.roll(twin, 1)]
    a = method_draws([z], y, counts, 15, list(RESAMPLED))
    b = method_draws([z], y, swapped, 15, list(RESAMPLED))
    assert all(same(a[m], b[m]) for m in RESAMPLED)


def test_the_calibration_test_ignores_the_order_of_the_rows(problem):
    z, y = problem
    reference = consistency_test(z, y, 15, 200, 0)
    seeds_reference = consistency_test([z, z / 2], y, 15, 200, 0)
    for seed in SHUFFLES[:2]:
        _, (zs, ys) = shuffled(seed, z, y)
        assert consistency_test(zs, ys, 15, 200, 0) == reference
        assert consistency_test([zs, zs / 2], ys, 15, 200, 0) == seeds_reference


LOGIT_METHODS = [name for name, spec in METHODS.items() if not spec.needs_model]


@pytest.mark.parametrize("name", LOGIT_METHODS)
def test_every_calibrator_fit_ignores_the_order_of_its_calibration_rows(name):
    z, y = pooled(7, 800, 11)
    test = torch.from_numpy(synthetic(7, 300, 12, decimals=1)[0])
    settings = {"progress": False} if "progress" in METHODS[name].run_options else {}
    reference = make_method(name, **settings).fit(z, y).transform(test)
    for seed in SHUFFLES[:2]:
        _, (zs, ys) = shuffled(seed, z, y)
        assert torch.equal(make_method(name, **settings).fit(zs, ys).transform(test), reference), f"shuffle {seed}"


def probabilities(rows):
    return np.array([[c, 1.0 - c] for c in rows])


def test_equal_confidences_share_an_equal_mass_bin():
    """Six confidences in 2 equal-mass bins: runs of 3, but four are 0.6, so the edge is 0.6 and all
    four 0.6 join the lower bin (3 right of 4: gap 0.15), the two 0.9 the upper (1 right: gap 0.4).
    AECE = 4/6 · 0.15 + 2/6 · 0.4; with the rows in any order."""
    conf = [0.6, 0.9, 0.6, 0.6, 0.9, 0.6]
    y = np.array([0, 0, 1, 0, 1, 0])  # class 0 predicted everywhere: right where the label is 0
    expected = 4 / 6 * 0.15 + 2 / 6 * 0.4
    for seed in (0, 1, 2, 3):
        perm = np.random.default_rng(seed).permutation(6)
        p = probabilities(np.array(conf)[perm])
        assert M.aece(p, y[perm], n_bins=2, from_probabilities=True) == pytest.approx(expected, abs=1e-15)
    assert M.equal_mass_bins(np.array(conf), 2).tolist() == [0, 1, 0, 0, 1, 0]
    # ℓ2 on the same bins: per bin (c̄ − ȳ)² − ȳ(1 − ȳ)/(n − 1).
    square = 4 / 6 * (0.15**2 - 0.75 * 0.25 / 3) + 2 / 6 * (0.4**2 - 0.5 * 0.5 / 1)
    assert M.l2_calibration_error(probabilities(conf), y, 2, from_probabilities=True) == pytest.approx(
        max(square, 0.0) ** 0.5, abs=1e-15)


def test_the_ks_error_steps_once_per_distinct_confidence():
    """Two samples at confidence 0.7, one right and one wrong, then one at 0.9, right. Steps of the
    cumulative Σ(c − correct): after the 0.7s, 0.7 + 0.7 − 1 = 0.4; after 0.9, 0.4 + 0.9 − 1 = 0.3.
    KS = 0.4 / 3, in either order of the tied pair (a step per sample would read 0.7/3 or 0.4/3)."""
    conf = np.array([0.7, 0.7, 0.9])
    for labels in ([0, 1, 0], [1, 0, 0]):
        assert M.ks_error(probabilities(conf), np.array(labels), from_probabilities=True) == pytest.approx(
            0.4 / 3, abs=1e-15)
