"""The newer calibrators against their reference implementations, on the same logits.

    PYTHONPATH=/path/to/refs python -m bench.calibrator_parity

References (not NCTV dependencies; install them into a folder of their own, e.g.
``pip install --target /tmp/refs --no-deps probmetrics==1.3.0 netcal==1.4.0 pytorch-minimize``):

* SVS and SMS: probmetrics 1.3.0, ``get_calibrator("svs" / "sms")`` (its default BFGS solver);
* ensemble temperature scaling: probmetrics' ``ETSCalibrator(loss="mse")``, the authors' formulas;
* histogram binning: netcal 1.4.0 ``HistogramBinning(bins=15, equal_intervals=False)``: netcal fits
  equal-mass bins but does not apply them (its transform raises for them), so its fitted bins are
  applied here with netcal's rule for bins (np.digitize, right-closed) and renormalised as netcal does;
* isotonic regression: netcal 1.4.0 ``IsotonicRegression`` (scikit-learn's, clipped, one-vs-rest,
  renormalised).

Inputs: the embedded default model's shipped test logits (``assets/precomputed/test_logits.safetensors``,
10,000 images, 10 classes), the first 5,000 as the calibration split and the other 5,000 scored; and a
binary problem made from them (classes 0 and 6 only: the model's logits of those two). Printed: the
largest absolute difference of the calibrated probabilities on the scored half.
"""
from __future__ import annotations

import numpy as np
import torch
from safetensors.numpy import load_file

from nctv.calibration import make_method

from bench.parity import LOGITS

#: The tolerance each comparison is held to (largest absolute difference of probabilities).
TOLERANCE = {"Structured Vector Scaling": 1e-3, "Structured Matrix Scaling": 5e-3,
             "Ensemble Temperature Scaling": 1e-6, "Histogram Binning": 1e-7, "Isotonic Regression": 1e-7}


def problems() -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    t = load_file(LOGITS)
    z, y = t["Uncalibrated"].astype(np.float64), t["labels"].astype(np.int64)
    half = len(y) // 2
    keep = np.isin(y, (0, 6))
    zb, yb = z[keep][:, [0, 6]], (y[keep] == 6).astype(np.int64)
    hb = len(yb) // 2
    return {"10 classes": (z[:half], y[:half], z[half:], y[half:]),
            "10 classes, z / 4": (z[:half] / 4, y[:half], z[half:] / 4, y[half:]),
            "2 classes": (zb[:hb], yb[:hb], zb[hb:], yb[hb:])}


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def ours(name: str, zc, yc, zt) -> tuple[np.ndarray, object]:
    cal = make_method(name).fit(torch.from_numpy(zc), torch.from_numpy(yc))
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


def probmetrics_reference(method: str, zc, yc, zt) -> tuple[np.ndarray, float | None]:
    """The reference's probabilities, and for SVS / SMS its objective (float64) at its own solution."""
    from probmetrics.calibrators import ETSCalibrator, get_calibrator

    cal = ETSCalibrator(loss="mse") if method == "ets" else get_calibrator(method, **{f"{method}_print_init_info": False})
    cal.fit(softmax(zc), yc)
    objective = None
    if method != "ets":
        t = 1.0 / float(cal.ts_.cal_.invtemp_)
        scale, bias = (cal.v_, cal.b_) if method == "svs" else (cal.W_[:, :-1], cal.W_[:, -1])
        objective = structured_objective(zc, yc, t, np.asarray(scale, np.float64), np.asarray(bias, np.float64))
    return cal.predict_proba(softmax(zt)), objective


def netcal_binning(zc, yc, zt) -> np.ndarray:
    from netcal.binning import HistogramBinning

    pc, pt = softmax(zc), softmax(zt)
    binary = pc.shape[1] == 2
    hb = HistogramBinning(bins=15, equal_intervals=False).fit(pc[:, 1] if binary else pc, yc)
    models = [(1, hb)] if binary else hb._multiclass_instances
    out = np.zeros_like(pt)
    for label, model in models:
        edges, values = model._bin_bounds[0], model._bin_map
        idx = np.clip(np.digitize(pt[:, label], edges, right=True) - 1, 0, len(values) - 1)
        out[:, label] = values[idx]
    if binary:
        out[:, 0] = 1.0 - out[:, 1]
    return out / out.sum(1, keepdims=True)


def netcal_isotonic(zc, yc, zt) -> np.ndarray:
    from netcal.binning import IsotonicRegression

    pc, pt = softmax(zc), softmax(zt)
    if pc.shape[1] == 2:
        q = IsotonicRegression().fit(pc[:, 1], yc).transform(pt[:, 1])
        return np.stack([1.0 - q, q], axis=1)
    return IsotonicRegression().fit(pc, yc).transform(pt)


REFERENCES = {
    "Structured Vector Scaling": ("probmetrics 1.3.0 get_calibrator('svs')",
                                  lambda *a: probmetrics_reference("svs", *a)),
    "Structured Matrix Scaling": ("probmetrics 1.3.0 get_calibrator('sms')",
                                  lambda *a: probmetrics_reference("sms", *a)),
    "Ensemble Temperature Scaling": ("probmetrics 1.3.0 ETSCalibrator(loss='mse')",
                                     lambda *a: probmetrics_reference("ets", *a)),
    "Histogram Binning": ("netcal 1.4.0 HistogramBinning(bins=15, equal_intervals=False), its bins applied",
                          netcal_binning),
    "Isotonic Regression": ("netcal 1.4.0 IsotonicRegression", netcal_isotonic),
}


def main() -> None:
    print("| method | reference | problem | largest difference | tolerance | objective: NCTV / reference |")
    print("| --- | --- | --- | ---: | ---: | --- |")
    for name, (label, reference) in REFERENCES.items():
        for problem, (zc, yc, zt, _) in problems().items():
            mine, cal = ours(name, zc, yc, zt)
            try:
                theirs = reference(zc, yc, zt)
            except ValueError as e:  # netcal's equal-mass bins where many scores coincide
                print(f"| {name} | {label} | {problem} | the reference refuses: {e} | | |", flush=True)
                continue
            theirs, objective = theirs if isinstance(theirs, tuple) else (theirs, None)
            diff = float(np.abs(mine - theirs).max())
            verdict = "" if diff <= TOLERANCE[name] else " (over)"
            both = "" if objective is None else f"{cal.objective_:.9f} / {objective:.9f}"
            print(f"| {name} | {label} | {problem} | {diff:.1e}{verdict} | {TOLERANCE[name]:.0e} | {both} |",
                  flush=True)


if __name__ == "__main__":
    main()
