"""The newer calibrators against their reference implementations, on the same logits.

    PYTHONPATH=/path/to/refs python -m bench.calibrator_parity [--out bench/results/calibrator_parity.md]

References (not NCTV dependencies; install them into a folder of their own, e.g.
``pip install --target /tmp/refs --no-deps probmetrics==1.3.0 netcal==1.4.0 pytorch-minimize
uncertainty-calibration==0.1.4``):

* SVS and SMS: probmetrics 1.3.0, ``get_calibrator("svs" / "sms")`` (its default BFGS solver);
* ensemble temperature scaling: probmetrics' ``ETSCalibrator(loss="mse")``, the authors' formulas;
* histogram binning, two references with different conventions (``nctv.calibration.nonparametric``),
  each against NCTV with the settings that follow it and with NCTV's defaults:

  - netcal 1.4.0 ``HistogramBinning(bins=15, equal_intervals=False)``: quantile edges, a score on an
    edge in the bin above (``on_edge="above"``). netcal fits equal-mass bins but does not apply them
    (its transform raises for them), so its fitted edges and bin values are applied here by the rule
    it fitted them with, scipy's ``binned_statistic`` (bins [a, b), the last one [a, 1]), and
    renormalised as netcal does;
  - Kumar, Liang & Ma's uncertainty-calibration 0.1.4 (module ``calibration``),
    ``HistogramMarginalCalibrator(n, 15)`` (10 classes, one-vs-rest) or ``HistogramCalibrator(n, 15)``
    on the positive class (2 classes, the other class its complement): edges halfway between runs of
    sorted scores, a score on an edge in the bin below (``edges="midpoint"``). It does not renormalise;
    its per-class values are renormalised here as NCTV does (each floored at 1e-12, then divided by
    the row's sum; for 2 classes the positive class's held within [1e-12, 1 − 1e-12]);
* isotonic regression: netcal 1.4.0 ``IsotonicRegression`` (scikit-learn's, clipped, one-vs-rest,
  renormalised), and scikit-learn's ``IsotonicRegression(out_of_bounds="clip")`` itself, one-vs-rest,
  renormalised as NCTV does: against the registered calibrator (float32 log-probabilities out) and
  against its float64 fit (``isotonic_fit``). Both sides pool scores closer than 1e-15 (float64's
  resolution) into the group's first.

Inputs: the embedded default model's shipped test logits (``assets/precomputed/test_logits.safetensors``,
10,000 images, 10 classes), the first 5,000 as the calibration split and the other 5,000 scored; and a
binary problem made from them (classes 0 and 6 only: the model's logits of those two); and the problems
every parity bench shares (``bench.parity_problems``: 2, 7, 20 and 100 classes drawn from seeds, 7 and 20
classes rounded to one decimal, 7 classes tied), each cut in halves the same way. Printed (and written to
``--out``): the largest absolute difference of the calibrated probabilities on the scored half; each
tolerance is the worst case over every problem, rounded up.
"""
from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
from safetensors.numpy import load_file

from nctv.calibration import make_method
from nctv.calibration.nonparametric import PROBABILITY_FLOOR

from bench import newest_parity
from bench.parity import LOGITS
from bench.parity_problems import parity_problems

#: Where the table is written.
RESULTS = Path(__file__).resolve().parent / "results" / "calibrator_parity.md"


def problems() -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    t = load_file(LOGITS)
    z, y = t["Uncalibrated"].astype(np.float64), t["labels"].astype(np.int64)
    half = len(y) // 2
    keep = np.isin(y, (0, 6))
    zb, yb = z[keep][:, [0, 6]], (y[keep] == 6).astype(np.int64)
    hb = len(yb) // 2
    shipped = {"10 classes": (z[:half], y[:half], z[half:], y[half:]),
               "10 classes, z / 4": (z[:half] / 4, y[:half], z[half:] / 4, y[half:]),
               "2 classes": (zb[:hb], yb[:hb], zb[hb:], yb[hb:])}
    return {**shipped, **{f"drawn: {name}": (z[:len(y) // 2], y[:len(y) // 2], z[len(y) // 2:], y[len(y) // 2:])
                          for name, (z, y) in parity_problems().items()}}


def softmax(z: np.ndarray) -> np.ndarray:
    """The probabilities NCTV's calibrators bin (float64, torch's softmax): a reference given numpy's own
    softmax would see scores one unit in the last place apart from NCTV's, which splits tied scores."""
    return torch.softmax(torch.from_numpy(np.asarray(z, dtype=np.float64)), dim=1).numpy()


def ours(name: str, zc, yc, zt, **settings) -> tuple[np.ndarray, object]:
    cal = make_method(name, **settings).fit(torch.from_numpy(zc), torch.from_numpy(yc))
    return torch.softmax(cal.transform(torch.from_numpy(zt)).double(), dim=1).numpy(), cal


def structured_objective(zc, yc, temperature, scale, bias) -> float:
    """The SVS / SMS objective (module notes of nctv.calibration.structured) in float64 at the given
    map: ``scale`` a vector (SVS) or a matrix (SMS)."""
    n, k = zc.shape
    eps = 1.0 / (n + 1)
    x = np.log((1 - eps) * softmax(zc / temperature) + eps / k)
    out = x * scale + bias if scale.ndim == 1 else x @ scale.T + bias
    out = out - out.max(1, keepdims=True)
    nll = float(np.mean(np.log(np.exp(out).sum(1)) - out[np.arange(n), yc]))
    change = scale - (1.0 if scale.ndim == 1 else np.eye(k))
    if scale.ndim == 1:
        return nll + k / n * (float((bias ** 2).sum()) + float((change ** 2).sum()))
    off = ~np.eye(k, dtype=bool)
    return nll + k / n * (float((bias ** 2).sum()) + float((np.diag(change) ** 2).sum())) \
        + k * (k - 1) / n * float((change[off] ** 2).sum())


def brier(p: np.ndarray, y: np.ndarray) -> float:
    """Mean squared error of probabilities against one-hot labels: ETS's objective (its weights' loss)."""
    return float(((p - np.eye(p.shape[1])[y]) ** 2).sum(1).mean())


def probmetrics_reference(method: str, zc, yc, zt) -> tuple[np.ndarray, float | None]:
    """The reference's probabilities and its objective (float64) at its own solution: for SVS / SMS their
    penalised NLL, for ETS the calibration split's mean squared error."""
    from probmetrics.calibrators import ETSCalibrator, get_calibrator

    cal = ETSCalibrator(loss="mse") if method == "ets" else get_calibrator(method, **{f"{method}_print_init_info": False})
    cal.fit(softmax(zc), yc)
    if method == "ets":
        objective = brier(np.asarray(cal.predict_proba(softmax(zc)), np.float64), yc)
    else:
        t = 1.0 / float(cal.ts_.cal_.invtemp_)
        scale, bias = (cal.v_, cal.b_) if method == "svs" else (cal.W_[:, :-1], cal.W_[:, -1])
        objective = structured_objective(zc, yc, t, np.asarray(scale, np.float64), np.asarray(bias, np.float64))
    return cal.predict_proba(softmax(zt)), objective


def netcal_binning(zc, yc, zt) -> np.ndarray:
    from netcal.binning import HistogramBinning
    from scipy.stats import binned_statistic

    pc, pt = softmax(zc), softmax(zt)
    binary = pc.shape[1] == 2
    hb = HistogramBinning(bins=15, equal_intervals=False).fit(pc[:, 1] if binary else pc, yc)
    models = [(1, hb)] if binary else hb._multiclass_instances
    out = np.zeros_like(pt)
    for label, model in models:
        edges, values = model._bin_bounds[0], model._bin_map
        # The bins netcal's fit used (scipy's binned_statistic_dd): [a, b), the last one closed.
        idx = binned_statistic(pt[:, label], pt[:, label], "count", bins=edges).binnumber - 1
        out[:, label] = values[idx]
    if binary:
        out[:, 0] = 1.0 - out[:, 1]
    return out / out.sum(1, keepdims=True)


def renormalised_as_nctv(q: np.ndarray) -> np.ndarray:
    """Per-class calibrated values (N, K) renormalised as NCTV's one-vs-rest calibrators do (module notes
    of nctv.calibration.nonparametric): for K = 2 the positive class's held within [floor, 1 − floor]
    and the other its complement; else each floored, then divided by the row's sum."""
    if q.shape[1] == 2:
        q1 = np.clip(q[:, 1], PROBABILITY_FLOOR, 1.0 - PROBABILITY_FLOOR)
        return np.stack([1.0 - q1, q1], axis=1)
    q = np.maximum(q, PROBABILITY_FLOOR)
    return q / q.sum(1, keepdims=True)


def kumar_binning(zc, yc, zt) -> np.ndarray:
    from calibration.calibrators import HistogramCalibrator, HistogramMarginalCalibrator

    pc, pt = softmax(zc), softmax(zt)
    if pc.shape[1] == 2:
        cal = HistogramCalibrator(len(yc), 15)
        cal.train_calibration(pc[:, 1], yc)
        q = np.zeros_like(pt)
        q[:, 1] = cal.calibrate(pt[:, 1])
    else:
        cal = HistogramMarginalCalibrator(len(yc), 15)
        cal.train_calibration(pc, yc)
        q = cal.calibrate(pt)
    return renormalised_as_nctv(q)


def netcal_isotonic(zc, yc, zt) -> np.ndarray:
    from netcal.binning import IsotonicRegression

    pc, pt = softmax(zc), softmax(zt)
    if pc.shape[1] == 2:
        q = IsotonicRegression().fit(pc[:, 1], yc).transform(pt[:, 1])
        return np.stack([1.0 - q, q], axis=1)
    return IsotonicRegression().fit(pc, yc).transform(pt)


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


def _float64_softmax(z: np.ndarray) -> np.ndarray:
    return torch.softmax(torch.as_tensor(z, dtype=torch.float64), dim=1).numpy()


def _one_vs_rest(pc, yc, pt, fit_predict: Callable) -> np.ndarray:
    """Per-class calibrated values (N, K) from ``fit_predict(scores, targets, scored)``, renormalised as NCTV."""
    q = np.zeros_like(pt)
    for k in ([1] if pc.shape[1] == 2 else range(pc.shape[1])):
        q[:, k] = fit_predict(pc[:, k], (yc == k).astype(np.float64), pt[:, k])
    return renormalised_as_nctv(q)


def sklearn_isotonic(zc, yc, zt) -> np.ndarray:
    from sklearn.isotonic import IsotonicRegression

    return _one_vs_rest(_float64_softmax(zc), yc, _float64_softmax(zt),
                        lambda x, t, s: IsotonicRegression(out_of_bounds="clip").fit(x, t).predict(s))


def nctv_isotonic(zc, yc, zt) -> np.ndarray:
    """NCTV's isotonic fit in float64 (``isotonic_fit``, then linear interpolation with the ends held, as
    ``IsotonicRegression`` applies it), before its head returns float32 log-probabilities."""
    from nctv.calibration.nonparametric import isotonic_fit

    def fit_predict(x, t, s):
        knots, values = isotonic_fit(x, t)
        return np.interp(s, knots, values)

    return _one_vs_rest(_float64_softmax(zc), yc, _float64_softmax(zt), fit_predict)


class Comparison(NamedTuple):
    method: str
    reference: str
    compute: Callable
    settings: dict
    #: The largest absolute difference of probabilities it is held to; None: a convention apart, shown only.
    tolerance: float | None
    #: NCTV's side when it is not the registered calibrator with ``settings`` (probabilities only).
    mine: Callable | None = None
    #: Both solve one optimisation problem to a stopping rule: NCTV's objective must also be at most the
    #: reference's (1e-9 of rounding allowed); the probabilities then differ by the reference's distance
    #: from the optimum, which the tolerance bounds over every problem.
    objective: bool = False


#: Rounding allowed when NCTV's objective is held to be at most the reference's.
OBJECTIVE_SLACK = 1e-9


HB_NETCAL = "netcal 1.4.0 HistogramBinning(bins=15, equal_intervals=False), its bins applied"
SK_ISOTONIC = f"scikit-learn {_version('scikit-learn')} IsotonicRegression(out_of_bounds='clip')"
HB_KUMAR = "uncertainty-calibration 0.1.4 HistogramMarginalCalibrator (2 classes: HistogramCalibrator)"

COMPARISONS = [
    Comparison("Structured Vector Scaling", "probmetrics 1.3.0 get_calibrator('svs')",
               lambda *a: probmetrics_reference("svs", *a), {}, 2e-3, objective=True),
    Comparison("Structured Matrix Scaling", "probmetrics 1.3.0 get_calibrator('sms')",
               lambda *a: probmetrics_reference("sms", *a), {}, 1e-2, objective=True),
    Comparison("Ensemble Temperature Scaling", "probmetrics 1.3.0 ETSCalibrator(loss='mse')",
               lambda *a: probmetrics_reference("ets", *a), {}, 1e-3, objective=True),
    Comparison("Histogram Binning", HB_NETCAL, netcal_binning, {"on_edge": "above"}, 1e-7),
    Comparison("Histogram Binning", HB_NETCAL, netcal_binning, {}, None),
    Comparison("Histogram Binning", HB_KUMAR, kumar_binning, {"edges": "midpoint"}, 1e-7),
    Comparison("Histogram Binning", HB_KUMAR, kumar_binning, {}, None),
    # Both pool scores closer than 1e-15 as scikit-learn does; the registered calibrator returns float32
    # log-probabilities, its float64 fit (the last row) is held to round-off.
    Comparison("Isotonic Regression", "netcal 1.4.0 IsotonicRegression", netcal_isotonic, {}, 1e-7),
    Comparison("Isotonic Regression", SK_ISOTONIC, sklearn_isotonic, {}, 1e-7),
    Comparison("Isotonic Regression", SK_ISOTONIC, sklearn_isotonic, {"fit": "in float64"}, 1e-12, nctv_isotonic),
]


def nctv_objective(cal, zc, yc) -> float:
    """NCTV's objective at its fit: SVS / SMS record theirs, ETS's is the calibration split's squared error."""
    if hasattr(cal, "objective_"):
        return float(cal.objective_)
    # ETS's mixture in float64 (its head returns float32 log-probabilities).
    w = cal.weights_.numpy()
    p = w[0] * softmax(zc / float(cal.temperature_)) + w[1] * softmax(zc) + w[2] / zc.shape[1]
    return brier(p, yc)


def largest_difference(c: Comparison, zc, yc, zt) -> tuple[float, tuple[float, float] | None]:
    """max |NCTV − reference| over the scored probabilities, and (NCTV's objective, the reference's) where
    ``c.objective``. ValueError where the reference refuses the problem."""
    if c.mine is None:
        mine, cal = ours(c.method, zc, yc, zt, **c.settings)
    else:
        mine, cal = c.mine(zc, yc, zt), None
    theirs = c.compute(zc, yc, zt)
    theirs, objective = theirs if isinstance(theirs, tuple) else (theirs, None)
    both = (nctv_objective(cal, zc, yc), objective) if c.objective else None
    return float(np.abs(mine - theirs).max()), both


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help=f"where the table is written (default: {RESULTS}, unless --methods)")
    ap.add_argument("--methods", nargs="*", help="only these methods (registry names); nothing written without --out")
    # --calibench, --tva and --spline go to bench.newest_parity, whose section of the file this keeps.
    args, newest = ap.parse_known_args(argv)
    out = args.out or (None if args.methods else RESULTS)
    lines = ["| method | reference | NCTV settings | problem | largest difference | tolerance | "
             "objective: NCTV / reference |", "| --- | --- | --- | --- | ---: | ---: | --- |"]
    print("\n".join(lines), flush=True)
    for c in COMPARISONS:
        if args.methods and c.method not in args.methods:
            continue
        settings = ("NCTV's isotonic_fit, " * (c.mine is not None)
                    + ", ".join(f"{k}={v!r}" if c.mine is None else f"{k} {v}" for k, v in c.settings.items())
                    or "defaults")
        for problem, (zc, yc, zt, _) in problems().items():
            try:
                diff, both = largest_difference(c, zc, yc, zt)
            except ValueError as e:  # netcal's equal-mass bins where its clipped scores tie at an edge
                cells = [f"the reference refuses: {e}", "", ""]
            else:
                tolerance = "" if c.tolerance is None else f"{c.tolerance:.0e}"
                lower = both is None or both[0] <= both[1] + OBJECTIVE_SLACK
                verdict = (" (convention)" if c.tolerance is None
                           else "" if diff <= c.tolerance and lower else " (over)")
                cells = [f"{diff:.1e}{verdict}", tolerance, "" if both is None else f"{both[0]:.12f} / {both[1]:.12f}"]
            line = "| " + " | ".join([c.method, c.reference, settings, problem, *cells]) + " |"
            lines.append(line)
            print(line, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("Made by `python -m bench.calibrator_parity` (docs/calibrators.md says what each row "
                       "compares).\n\n" + "\n".join(lines) + "\n" + newest_parity.section(newest, out))
        print(f"written: {out}")


if __name__ == "__main__":
    main()
