"""Conformal sets on the embedded default: LAC, APS and RAPS on top of three calibrators.

    python -m bench.conformal_default            # about a minute on 2 CPU cores

The embedded default model's calibration split (5,000 Fashion-MNIST pictures) is cut in two at random
(``nctv.conformal.split_calibration``, seed 0): each calibrator is fitted on one half and the sets are
conformalised on the other, so the finite-sample guarantee holds (SPEC §7). The sets are scored on the
whole test split (10,000 pictures) with 95 % intervals (1,000 resamples, seed 0). Every score not
randomised (the default), then APS and RAPS randomised (seed 0), then LAC with one q̂ per class;
RAPS with λ = 0.01, k_reg = 5. Prints the Markdown table of docs/conformal.md.
"""
from __future__ import annotations

import argparse
import time

import nctv.data as d
import nctv.zoo as z
from nctv.cache import split_logits
from nctv.calibration import make_method
from nctv.methods import METHODS as METHODS_REGISTRY
from nctv.results import COMPARED_METHOD
from nctv.conformal import SCORES, ConformalPredictor, ConformalSettings, split_calibration
from nctv.inference import model_logits

METHODS = ("Uncalibrated", "Temperature Scaling", COMPARED_METHOD)


def calibrated_logits(coverage: float = 0.9, seed: int = 0):
    """{method: (conformal-half logits, labels, test logits, labels)}, each method fitted on the other half."""
    m = z.load_model(z.DEFAULT_MODEL)
    cal, test = d.get_splits(m, calibration_size=5000)
    zc = split_logits(m.model, cal).logits
    zt = split_logits(m.model, test).logits
    (xc, yc), (xt, yt) = cal.tensors(), test.tensors()
    fit, conf = split_calibration(len(yc), 0.5, seed)
    out = {}
    for name in METHODS:
        if METHODS_REGISTRY[name].needs_model:
            nc = make_method(name, model=m.model, input_range=m.input_range, seed=seed).fit(xc[fit], yc[fit])
            out[name] = (nc.predict_logits(xc[conf]), yc[conf], nc.predict_logits(xt), yt)
        else:
            method = make_method(name).fit(zc[fit], yc[fit])
            out[name] = (method.transform(zc[conf]), yc[conf], method.transform(zt), yt)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--coverage", type=float, default=0.9)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    logits = calibrated_logits(args.coverage)
    print("| calibrator | set | coverage % [95 % interval] | mean set size | worst class: coverage % | empty sets % |")
    print("| --- | --- | --- | --- | --- | ---: |")
    for name, (zc, yc, zt, yt) in logits.items():
        rows = [(s, False, False) for s in SCORES] + [("aps", True, False), ("raps", True, False), ("lac", False, True)]
        for score, rnd, cc in rows:
            st = ConformalSettings(score, args.coverage, randomized=rnd, class_conditional=cc)
            ev = ConformalPredictor(st).fit(zc, yc).evaluate(zt, yt)
            c, s, w = ev.coverage, ev.mean_size, ev.worst_class_coverage
            print(f"| {name} | {score.upper()}{' randomised' if rnd else ''}{' class-conditional' if cc else ''} | {100 * c.estimate:.2f} [{100 * c.low:.2f}, {100 * c.high:.2f}] | "
                  f"{s.estimate:.3f} [{s.low:.3f}, {s.high:.3f}] | class {ev.worst_class}: {100 * w.estimate:.1f} "
                  f"[{100 * w.low:.1f}, {100 * w.high:.1f}] | {100 * ev.empty:.2f} |")
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
