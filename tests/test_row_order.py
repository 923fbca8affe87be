"""A whole run is a function of its rows, not of their order: the same calibration and test rows in
another order give the same results.json, every interval, p-value, verdict and conformal figure to the
last bit (`nctv run --logits` on a row-permuted file), the same RAPS tuning and sets, the same model run,
γ sweep, initialisation study and shift study for the test pictures in another order.

The data are full of ties (bench.parity_problems: logits rounded to one decimal, rows drawn again and
again from a few dozen), where a draw that followed the rows' places used to move every interval.
"""
import csv
import json

import numpy as np
import pytest
import torch

import nctv.conformal as C
from bench.parity_problems import pooled, synthetic
from nctv import experiment
from nctv.cli import main
from nctv.data import get_splits
from nctv.canonical import canonical_order
from nctv.intervals import IntervalSettings, resample_counts_for
from nctv.shift import run_shift

# What a run records of how long it took and of the order its files were written in: the rest is figures.
NOT_FIGURES = {"seconds", "created", "fit_seconds", "timing", "cache_hits", "fingerprint", "indices"}


def figures(record):
    """Everything a result holds but timings and the splits' fingerprints (of the content in its order)."""
    if isinstance(record, dict):
        return {k: figures(v) for k, v in record.items() if k not in NOT_FIGURES}
    if isinstance(record, list):
        return [figures(v) for v in record]
    return record


def moved(a, b, path=""):
    """The paths where two records differ (NaN equal to NaN)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [p for k in a.keys() | b.keys() for p in moved(a.get(k), b.get(k), f"{path}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for i, (u, v) in enumerate(zip(a, b)) for p in moved(u, v, f"{path}[{i}]")]
    same = a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)
    return [] if same else [f"{path}: {a!r} against {b!r}"]


def test_resamples_follow_the_rows_not_their_places():
    """resample_counts_for: seed s's index draws of the places 0..N−1 of the canonical order, each place's
    counts given to the row standing there; the same rows shuffled get their own counts back."""
    z, y = synthetic(4, 250, 12, decimals=1)
    counts = resample_counts_for((z, y), 100, 6)
    index = torch.randint(250, (100, 250), generator=torch.Generator().manual_seed(6))
    at_place = torch.stack([torch.bincount(row, minlength=250) for row in index]).float()
    assert torch.equal(counts[:, canonical_order(z, y)], at_place)
    shuffle = np.random.default_rng(1).permutation(250)
    assert torch.equal(resample_counts_for((z[shuffle], y[shuffle]), 100, 6), counts[:, shuffle])


def _write(folder, layout, z, y, cut):
    folder.mkdir()
    if layout == "npz, both splits":
        path = folder / "logits.npz"
        np.savez(path, calibration_logits=z[:cut], calibration_labels=y[:cut], test_logits=z[cut:], test_labels=y[cut:])
        return path
    path = folder / "logits.csv"  # one set, split in halves by the seed
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", *(f"c{j}" for j in range(z.shape[1]))])
        w.writerows([int(label), *map(repr, row.tolist())] for row, label in zip(z, y))
    return path


@pytest.mark.parametrize("layout, methods, score", [
    ("npz, both splits", [], "raps"),  # the paper's logit methods
    ("csv, one set", ["uncal", "ts", "ms-odir", "iso", "spline", "smart"], "lac"),
])
def test_a_permuted_logits_file_gives_the_same_results(tmp_path, layout, methods, score):
    """`nctv run --logits` on a file and on the same rows shuffled (each split on its own, or the one set
    before it is halved): results.json and the table are the same to the last bit."""
    z, y = synthetic(5, 360, 31, decimals=1)
    z[200:260], y[200:260] = pooled(5, 60, 32)  # rows repeated many times over, ties in every figure
    rng = np.random.default_rng(4)
    shuffle = (np.r_[rng.permutation(180), 180 + rng.permutation(180)] if layout == "npz, both splits"
               else rng.permutation(360))
    out = []
    for name, rows in (("given", np.arange(360)), ("shuffled", shuffle)):
        path = _write(tmp_path / name, layout, z[rows], y[rows], 180)
        args = ["run", "--logits", str(path), "--seeds", "1", "--bins", "15", "--resamples", "100",
                "--conformal", score, "--out", str(tmp_path / name / "out"), "--quiet", "--no-cache"]
        assert main(args + (["--methods", *methods] if methods else [])) == 0
        out.append(tmp_path / name / "out")
    given, shuffled = (json.loads((o / "results.json").read_text()) for o in out)
    assert given["comparisons"] and all(m["conformal"]["coverage"][1] < m["conformal"]["coverage"][2]
                                        for m in given["methods"].values())
    assert not moved(figures(given), figures(shuffled))
    assert (out[0] / "table.md").read_text() == (out[1] / "table.md").read_text()


def held_out(z, y, rows):
    """The rows ``rows`` of (z, y) as a multiset: each distinct row with how often it is there."""
    values, counts = np.unique(np.c_[z[rows].numpy(), y[rows].numpy()], axis=0, return_counts=True)
    return values.tolist(), counts.tolist()


@pytest.mark.parametrize("settings", [
    C.ConformalSettings("raps", randomized=True, seed=5),
    C.ConformalSettings("raps", class_conditional=True, seed=2),
    C.ConformalSettings("aps", randomized=True, seed=1),
])
def test_conformal_sets_ignore_the_order_of_the_rows(settings):
    """RAPS's tuning part, λ, k_reg and q̂, and every set and figure on the test split, for the rows in
    any order: the seeded draws (the tuning part, v) follow the rows, identical rows included."""
    z, y = pooled(6, 900, 8)
    z[::3], y[::3] = synthetic(6, 300, 9, decimals=1)
    zc, yc, zt, yt = (torch.from_numpy(a) for a in (z[:500], y[:500], z[500:], y[500:]))
    reference = C.ConformalPredictor(settings).fit(zc, yc)
    evaluated = reference.evaluate(zt, yt, intervals=IntervalSettings(resamples=200))
    for seed in (1, 2):
        rng = np.random.default_rng(seed)
        cal, test = torch.from_numpy(rng.permutation(500)), torch.from_numpy(rng.permutation(400))
        again = C.ConformalPredictor(settings).fit(zc[cal], yc[cal])
        assert again.to_dict() == reference.to_dict() and again.tuning_sizes_ == reference.tuning_sizes_
        assert again.threshold_ == reference.threshold_ and torch.equal(again.thresholds_, reference.thresholds_)
        # The same rows held out to tune (which copy of a repeated row is held out changes nothing).
        assert held_out(zc[cal], yc[cal], again.tuning_indices_) == held_out(zc, yc, reference.tuning_indices_)
        assert again.evaluate(zt[test], yt[test], intervals=IntervalSettings(resamples=200)) == evaluated
    # Rows of distinct probabilities keep their own set wherever they stand.
    untied, _ = synthetic(6, 300, 10)
    shuffle = np.random.default_rng(3).permutation(300)
    sets = reference.predict_sets(untied)
    assert torch.equal(reference.predict_sets(untied[shuffle]), sets[shuffle])


@pytest.fixture(scope="module")
def pictures(default_model):
    """The embedded model's splits, and its test split with the pictures in another order."""
    cal, test = get_splits(default_model, calibration_size=600, test_size=400)
    return default_model, cal, test, test.subset(np.random.default_rng(5).permutation(len(test)))


RUNS = {
    "run": lambda m, cal, test: experiment.run_experiment(
        m, cal, test, ["Uncalibrated", "Temperature Scaling", "Neural Clamping (FL)", "NC (Eff.)"], seeds=1,
        bins=(15,), cache_dir=False, progress=False, max_passes=6, intervals=IntervalSettings(resamples=100),
        conformal=C.ConformalSettings("raps", randomized=True)),
    "γ sweep": lambda m, cal, test: experiment.run_gamma_sweep(m, cal, test, gammas=[0.0, 1.0], progress=False,
                                                                max_passes=6),
    "initialisation study": lambda m, cal, test: experiment.run_init_study(m, cal, test, runs=2, progress=False,
                                                                            max_passes=6),
    "shift study": lambda m, cal, test: run_shift(
        m, cal, test, ["contrast"], [2], ["Uncalibrated", "Temperature Scaling", "Neural Clamping (FL)"],
        cache_dir=False, progress=False, max_passes=6, intervals=IntervalSettings(resamples=100), examples=2),
}


@pytest.mark.parametrize("kind", list(RUNS))
def test_a_model_run_ignores_the_order_of_the_test_pictures(pictures, kind):
    """The resamples of a run on pictures are keyed by the test pictures' content and labels, which every
    method shares: the test pictures in another order give the same figures (and the shift study shows the
    same example pictures)."""
    model, cal, test, shuffled = pictures
    given, again = (figures(RUNS[kind](model, cal, split).to_dict()) for split in (test, shuffled))
    assert not moved(given, again)


class _LastBits(torch.nn.Module):
    """The model with every logit moved by one unit in its last place: as another CPU's kernels round."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.inner = model  # not "model": a run unwraps an object's .model as a zoo model's

    def forward(self, x):
        z = self.inner(x)
        return torch.nextafter(z, torch.full_like(z, float("inf")))


def test_a_runs_intervals_and_tests_follow_the_pictures_not_the_logits_last_bits(pictures):
    """Another CPU rounds the model's logits differently in their last bits. Resamples and calibration
    tests keyed by the logits were then drawn anew (the default run's accuracy interval moved by 0.07 point
    across kernel sets); keyed by the pictures, every interval stays within rounding and every p-value and
    verdict is the same."""
    model, cal, test, _ = pictures
    settings = IntervalSettings(resamples=200)

    def run(module):
        return experiment.run_experiment(module, cal, test, ["Uncalibrated", "Temperature Scaling"], seeds=1,
                                         bins=(15,), cache_dir=False, progress=False, intervals=settings,
                                         conformal=None).to_dict()

    given, nudged = run(model.model), run(_LastBits(model.model))
    compared = 0
    for name, method in given["methods"].items():
        for metric, stats in method["metrics"]["15"].items():
            other = nudged["methods"][name]["metrics"]["15"][metric]
            if metric.endswith("calibration_p"):
                assert other["mean"] == stats["mean"], (name, metric)
            for end in ("ci_low", "ci_high"):
                if stats.get(end) is not None:
                    assert other[end] == pytest.approx(stats[end], rel=1e-5, abs=1e-6), (name, metric, end)
                    compared += 1
    assert compared >= 10
    # The nudge is real: the logits' bytes, and so their canonical order, differ.
    x, y = test.tensors()
    with torch.no_grad():
        z = model.model(x[:50])
        assert not np.array_equal(canonical_order(z, y[:50]), canonical_order(_LastBits(model.model)(x[:50]), y[:50]))
