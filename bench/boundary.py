"""Coverage of the ECE interval at the boundary: a calibrated model (population ECE 0) and a nearly
calibrated one, before and after the calibration test widens an interval to 0.

    python -m bench.boundary [--sets 200] [--n 5000] [--resamples 1000] [--write]

The model: logits z ~ N(0, s²·I) over K = 10 classes (s = 2), labels drawn from softmax(z), so
softmax(z) is calibrated exactly; the nearly calibrated model reports softmax(z / T) for the same
labels (T = 1.01 and 1.02: slightly under-confident, population ECE 0.33 % and 0.66 %, where the
ECE of a calibrated model on 5,000 samples reads about 1.8 %). Its population ECE with the
table's 15 bins, Σ_b |E[(q − c)·1[c ∈ b]]| with q = softmax(z)_ŷ the probability that the prediction is
right, is computed from 4,000,000 draws of z (no labels drawn: q is the exact conditional accuracy).

"Before": the run's interval (``nctv.intervals.interval``: debiased estimate, basic ∪ percentile
bootstrap). "After": the same, widened to 0 where the calibration test (``nctv.consistency``) does not
reject at 5 % (``nctv.intervals.at_boundary``). Coverage: the share of test sets whose interval holds
the population value. ``--write`` writes bench/results/boundary.json and .md.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nctv.consistency import consistency_test
from nctv.intervals import at_boundary, interval, method_draws, resample_counts
from nctv.metrics import bin_edges

OUT = Path(__file__).resolve().parent / "results"
K, SCALE, N_BINS = 10, 2.0, 15


@dataclass(frozen=True)
class Case:
    """A model reporting softmax(z / ``temperature``) for labels drawn from softmax(z)."""

    name: str
    temperature: float


CASES = (Case("calibrated (T = 1)", 1.0), Case("nearly calibrated (T = 1.01)", 1.01),
         Case("nearly calibrated (T = 1.02)", 1.02))


def draw(n: int, generator: torch.Generator, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples: the model's logits z / T and labels drawn from softmax(z)."""
    z = torch.randn(n, K, generator=generator, dtype=torch.float64) * SCALE
    labels = torch.multinomial(torch.softmax(z, 1), 1, generator=generator).squeeze(1)
    return z / temperature, labels


def population_ece(temperature: float, n: int = 4_000_000, seed: int = 12345, n_bins: int = N_BINS) -> float:
    """Σ_b |E[(q − c)·1[c ∈ b]]| by Monte Carlo over z, q = softmax(z)_ŷ exact (no label noise)."""
    g = torch.Generator().manual_seed(seed)
    gap = torch.zeros(n_bins, dtype=torch.float64)
    chunk = 500_000
    for start in range(0, n, chunk):
        z = torch.randn(min(chunk, n - start), K, generator=g, dtype=torch.float64) * SCALE
        q, pred = torch.softmax(z, 1).max(1)
        c = torch.softmax(z / temperature, 1).gather(1, pred[:, None]).squeeze(1)
        b = (torch.searchsorted(bin_edges(n_bins), c, right=False) - 1).clamp(0, n_bins - 1)
        gap += torch.bincount(b, weights=q - c, minlength=n_bins)
    return float(gap.abs().sum() / n)


def coverage(case: Case, truth: float, sets: int, n: int, resamples: int, seed: int = 0,
             level: float = 0.95) -> dict:
    """Coverage before and after over ``sets`` seeded test sets of ``n`` samples."""
    g = torch.Generator().manual_seed(seed)
    before = after = rejected = 0
    widths = []
    for i in range(sets):
        z, y = draw(n, g, case.temperature)
        d = method_draws([z], y, resample_counts(n, resamples, 1000 + i), N_BINS, ["ece"])["ece"]
        iv = interval(d, "ece", level)
        p = consistency_test(z, y, N_BINS, resamples, seed=2000 + i).p_top_label
        wide = at_boundary(iv, p, level)
        before += iv.low <= truth <= iv.high
        after += wide.low <= truth <= wide.high
        rejected += p < 1 - level
        widths.append(wide.high - wide.low)
    return {"case": case.name, "temperature": case.temperature, "population_ece": truth, "sets": sets, "n": n,
            "resamples": resamples, "coverage_before": before / sets, "coverage_after": after / sets,
            "test_rejects": rejected / sets, "mean_width_after": float(np.mean(widths))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", type=int, default=200)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for case in CASES:
        truth = population_ece(case.temperature)
        rows.append(coverage(case, truth, args.sets, args.n, args.resamples))
        print(rows[-1], flush=True)
    lines = ["| model | population ECE (%) | 95 % interval covers it, before | after | test rejects H₀ |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['case']} | {100 * r['population_ece']:.3f} | {100 * r['coverage_before']:.1f} % | "
              f"{100 * r['coverage_after']:.1f} % | {100 * r['test_rejects']:.1f} % |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if args.write:
        OUT.mkdir(exist_ok=True)
        (OUT / "boundary.json").write_text(json.dumps({"rows": rows, "seconds": time.perf_counter() - t0,
                                                       "settings": vars(args)}, indent=2))
        (OUT / "boundary.md").write_text(
            f"# Coverage at the boundary\n\n{args.sets} test sets of {args.n} samples, {args.resamples} resamples, "
            f"K = {K}, logits N(0, {SCALE}²), 15 bins (`python -m bench.boundary --write`).\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
