"""Conformal sets on the embedded default: LAC, APS and RAPS on top of three calibrators.

    python -m bench.conformal_default [--write]      # 2 to 4 minutes on 2 CPU cores

The embedded default model's calibration split (5,000 Fashion-MNIST pictures) is cut in two at random
(``nctv.conformal.split_calibration``, seed 0): each calibrator is fitted on one half and the sets are
conformalised on the other, so the finite-sample guarantee holds (SPEC §7). The sets are scored on the
whole test split (10,000 pictures) with 95 % intervals (1,000 resamples, seed 0). Every score not
randomised (the default), then APS and RAPS randomised (seed 0), then LAC with one q̂ per class.
RAPS twice each: with the authors' fixed λ = 0.01, k_reg = 5, and tuned as the RAPS paper does
(``ConformalSettings``' default: 30 % of the conformal half held out to choose λ and k_reg, q̂ from
the other 70 %). Prints the Markdown table of docs/conformal.md; ``--write`` also writes it, with every
figure and the chosen λ and k_reg, to bench/results/conformal_default.md and .json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import nctv.data as d
import nctv.zoo as z
from nctv.cache import split_logits
from nctv.calibration import make_method
from nctv.methods import METHODS as METHODS_REGISTRY
from nctv.results import COMPARED_METHOD
from nctv.conformal import RAPS_K_REG, RAPS_PENALTY, ConformalPredictor, ConformalSettings, split_calibration
from nctv.inference import model_logits
from nctv.intervals import resample_counts_for

METHODS = ("Uncalibrated", "Temperature Scaling", COMPARED_METHOD)
OUT = Path(__file__).resolve().parent / "results"
FIXED = {"penalty": RAPS_PENALTY, "k_reg": RAPS_K_REG}
#: (row label, ConformalSettings keywords beside the coverage): every row of the table, in order.
ROWS = (("LAC", {"score": "lac"}), ("APS", {"score": "aps"}),
        ("RAPS λ = 0.01, k_reg = 5", {"score": "raps", **FIXED}), ("RAPS tuned", {"score": "raps"}),
        ("APS randomised", {"score": "aps", "randomized": True}),
        ("RAPS randomised λ = 0.01, k_reg = 5", {"score": "raps", "randomized": True, **FIXED}),
        ("RAPS randomised tuned", {"score": "raps", "randomized": True}),
        ("LAC class-conditional", {"score": "lac", "class_conditional": True}))


def calibrated_logits(coverage: float = 0.9, seed: int = 0):
    """{method: (conformal-half logits, labels, test logits, labels)}, each method fitted on the other half,
    and the test split's resamples, keyed by its unperturbed logits and labels (every method's, as a run's)."""
    m = z.load_model(z.DEFAULT_MODEL)
    cal, test = d.get_splits(m, calibration_size=5000)
    zc = split_logits(m.model, cal).logits
    zt = split_logits(m.model, test).logits
    (xc, yc), (xt, yt) = cal.tensors(), test.tensors()
    fit, conf = split_calibration(zc, yc, 0.5, seed)
    out = {}
    for name in METHODS:
        if METHODS_REGISTRY[name].needs_model:
            nc = make_method(name, model=m.model, input_range=m.input_range, seed=seed).fit(xc[fit], yc[fit])
            out[name] = (nc.predict_logits(xc[conf]), yc[conf], nc.predict_logits(xt), yt)
        else:
            method = make_method(name).fit(zc[fit], yc[fit])
            out[name] = (method.transform(zc[conf]), yc[conf], method.transform(zt), yt)
    return out, resample_counts_for((zt, yt), 1000, 0)


def measure(logits: dict, counts, coverage: float = 0.9) -> list[dict]:
    """One record per (calibrator, row of ``ROWS``): the figures with their intervals (on the resamples
    ``counts``) and the values used."""
    records = []
    for name, (zc, yc, zt, yt) in logits.items():
        for label, keywords in ROWS:
            cp = ConformalPredictor(ConformalSettings(coverage=coverage, **keywords)).fit(zc, yc)
            ev = cp.evaluate(zt, yt, counts=counts)
            triple = lambda i: [i.estimate, i.low, i.high]  # noqa: E731
            records.append({"calibrator": name, "set": label, **cp.to_dict(), "threshold": cp.threshold_,
                            "tuning_sizes": {str(k): v for k, v in cp.tuning_sizes_.items()},
                            "coverage": triple(ev.coverage), "mean_size": triple(ev.mean_size),
                            "worst_class": ev.worst_class, "worst_class_coverage": triple(ev.worst_class_coverage),
                            "empty": ev.empty})
    return records


def table(records: list[dict]) -> str:
    lines = ["| calibrator | set | λ, k_reg | coverage % [95 % interval] | mean set size | worst class: coverage % | empty sets % |",
             "| --- | --- | --- | --- | --- | --- | ---: |"]
    for r in records:
        c, s, w = r["coverage"], r["mean_size"], r["worst_class_coverage"]
        used = "—" if r["k_reg"] is None else f"{r['penalty']:g}, {r['k_reg']}"
        lines.append(f"| {r['calibrator']} | {r['set']} | {used} | {100 * c[0]:.2f} [{100 * c[1]:.2f}, {100 * c[2]:.2f}] | "
                     f"{s[0]:.3f} [{s[1]:.3f}, {s[2]:.3f}] | class {r['worst_class']}: {100 * w[0]:.1f} "
                     f"[{100 * w[1]:.1f}, {100 * w[2]:.1f}] | {100 * r['empty']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--coverage", type=float, default=0.9)
    ap.add_argument("--write", action="store_true", help="write bench/results/conformal_default.md and .json")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    records = measure(*calibrated_logits(args.coverage), args.coverage)
    text = table(records)
    seconds = time.perf_counter() - start
    print(text)
    print(f"\n{seconds:.0f} s")
    if args.write:
        tuned = next(r for r in records if r["tuned"])
        OUT.mkdir(exist_ok=True)
        (OUT / "conformal_default.json").write_text(json.dumps({"coverage": args.coverage, "seconds": seconds,
                                                                 "rows": records}, indent=1) + "\n", encoding="utf-8")
        (OUT / "conformal_default.md").write_text(
            f"# Conformal sets on the embedded default at {100 * args.coverage:g} %\n\n"
            "`python -m bench.conformal_default --write`: each calibrator fitted on one half of the 5,000 calibration "
            "pictures, the sets conformalised on the other half (RAPS tuned: "
            f"{tuned['n_tune']:,} of its {tuned['n_tune'] + tuned['n_conformal']:,} pictures held out to choose λ and "
            f"k_reg, q̂ from the other {tuned['n_conformal']:,}), scored on the 10,000 test pictures with 95 % "
            "intervals. λ, k_reg: the values the sets used.\n\n"
            f"{text}\n\n{seconds:.0f} s on this machine.\n", encoding="utf-8")


if __name__ == "__main__":
    main()
