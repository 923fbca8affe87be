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
the population value.

Paired differences: two "methods" scored on the same test labels, A reporting softmax(z / T_A) and B
softmax(z / T_B) (PAIRS: a calibrated one against under-confident ones, two nearly calibrated ones, and
two clearly miscalibrated ones). Their population difference is population ECE(T_A) − population
ECE(T_B) (the same 4,000,000 draws of z for both). "Before": the run's paired interval
(``nctv.intervals.difference`` on the run's one count matrix, 1000 resamples). "After": widened by
``nctv.intervals.difference_at_boundary`` from each method's calibration test (run's seed for both)
and its interval after ``at_boundary``. Widths are reported where neither test can say "calibrated"
(where the rule must leave the interval alone) and overall. Every temperature is scored once per test
set; the single-model rows use exactly the draws they always did. ``--write`` writes
bench/results/boundary.json and .md.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from nctv.consistency import consistency_test
from nctv.intervals import (MethodDraws, at_boundary, consistent, difference, difference_at_boundary, interval,
                            method_draws, resample_counts)
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


@dataclass(frozen=True)
class Pair:
    """Method A reports softmax(z / ``a``), method B softmax(z / ``b``), for the same labels."""

    name: str
    a: float
    b: float


PAIRS = (Pair("calibrated − clearly under-confident", 1.0, 1.25),
         Pair("calibrated − slightly under-confident", 1.0, 1.05),
         Pair("calibrated − nearly calibrated", 1.0, 1.02),
         Pair("calibrated − nearly calibrated (closer)", 1.0, 1.01),
         Pair("two nearly calibrated", 1.01, 1.02),
         Pair("calibrated − uniform (both calibrated)", 1.0, math.inf),
         Pair("slightly − clearly under-confident", 1.05, 1.25),
         Pair("two clearly miscalibrated", 1.25, 1.5))


def draw(n: int, generator: torch.Generator, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples: the model's logits z / T and labels drawn from softmax(z)."""
    z = torch.randn(n, K, generator=generator, dtype=torch.float64) * SCALE
    labels = torch.multinomial(torch.softmax(z, 1), 1, generator=generator).squeeze(1)
    return z / temperature, labels


def population_ece(temperature: float, n: int = 4_000_000, seed: int = 12345, n_bins: int = N_BINS) -> float:
    """Σ_b |E[(q − c)·1[c ∈ b]]| by Monte Carlo over z, q = softmax(z)_ŷ exact (no label noise).

    T = ∞: the uniform model (every logit 0) says 1/K and predicts class 0, right with probability
    E[softmax(z)_0] = 1/K (the classes are exchangeable): calibrated, population ECE exactly 0."""
    if math.isinf(temperature):
        return 0.0
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


def scored(sets: int, n: int, resamples: int, temperatures: list[float], seed: int = 0):
    """Per test set (``sets`` seeded sets of ``n``), per temperature: its ECE draws on the set's one count
    matrix and its calibration test's p-value. One set's labels serve every temperature (paired), as
    one run's test split serves every method; T = ∞ is the uniform model (logits 0)."""
    g = torch.Generator().manual_seed(seed)
    for i in range(sets):
        z, y = draw(n, g)
        counts = resample_counts(n, resamples, 1000 + i)
        out = {}
        for t in temperatures:
            zt = torch.zeros_like(z) if math.isinf(t) else z / t
            d = method_draws([zt], y, counts, N_BINS, ["ece"])["ece"]
            out[t] = (d, consistency_test(zt, y, N_BINS, resamples, seed=2000 + i).p_top_label)
        yield out


def save_draws(path: Path, per_set: list[dict], temperatures: list[float], seconds: float) -> None:
    """Every set's draws and p-values, as arrays (``np.savez``: no pickle), so a rule can be re-scored;
    ``seconds``: what scoring them took."""
    arrays = {"temperatures": np.array(temperatures), "seconds": np.array(seconds)}
    for j, t in enumerate(temperatures):
        got = [s[t] for s in per_set]
        arrays[f"draws_{j}"] = np.stack([d.draws.numpy() for d, _ in got])
        arrays[f"point_{j}"] = np.array([d.point for d, _ in got])
        arrays[f"estimate_{j}"] = np.array([d.estimate for d, _ in got])
        arrays[f"p_{j}"] = np.array([p for _, p in got])
    np.savez(path, **arrays)


def load_draws(path: Path, temperatures: list[float]) -> tuple[list[dict], float | None]:
    """What :func:`save_draws` wrote, checked to hold ``temperatures``, and the seconds scoring took."""
    with np.load(path, allow_pickle=False) as f:
        seconds = float(f["seconds"]) if "seconds" in f.files else None
        saved = [float(t) for t in f["temperatures"]]
        if saved != temperatures:
            raise SystemExit(f"{path} holds temperatures {saved}, this bench needs {temperatures}.")
        cols = {j: (f[f"draws_{j}"], f[f"point_{j}"], f[f"estimate_{j}"], f[f"p_{j}"]) for j in range(len(saved))}
    sets = len(cols[0][1])
    return [{t: (MethodDraws(float(cols[j][1][i]), float(cols[j][2][i]), torch.from_numpy(cols[j][0][i])),
                 float(cols[j][3][i])) for j, t in enumerate(temperatures)} for i in range(sets)], seconds


def _intervals(per_set: list[dict], level: float = 0.95) -> list[dict]:
    """Per set and temperature: (draws, interval before, after ``at_boundary``, p-value)."""
    out = []
    for one in per_set:
        row = {}
        for t, (d, p) in one.items():
            ci = interval(d, "ece", level)
            row[t] = (d, ci, at_boundary(ci, p, level), p)
        out.append(row)
    return out


def single_row(case: Case, truth: float, per_set: list[dict], level: float = 0.95) -> dict:
    """Coverage of one model's ECE interval before and after ``at_boundary``."""
    sets = len(per_set)
    got = [s[case.temperature] for s in per_set]
    before = sum(iv.low <= truth <= iv.high for _, iv, _, _ in got)
    after = sum(w.low <= truth <= w.high for _, _, w, _ in got)
    rejected = sum(p < 1 - level for *_, p in got)
    return {"case": case.name, "temperature": case.temperature, "population_ece": truth, "sets": sets,
            "coverage_before": before / sets, "coverage_after": after / sets, "test_rejects": rejected / sets,
            "mean_width_after": float(np.mean([w.high - w.low for _, _, w, _ in got]))}


def _json_t(t: float) -> float | str:
    return "inf" if math.isinf(t) else t


def _t(t: float | str) -> str:
    return "∞" if t == "inf" or (isinstance(t, float) and math.isinf(t)) else f"{t:g}"


def coverage(case: Case, truth: float, sets: int, n: int, resamples: int, seed: int = 0,
             level: float = 0.95) -> dict:
    """Coverage of one model's ECE interval before and after, over ``sets`` seeded test sets of ``n``
    (the single-model rows on their own; tests/test_calibration_checks.py runs a small one)."""
    per_set = _intervals(list(scored(sets, n, resamples, [case.temperature], seed)), level)
    return {**single_row(case, truth, per_set, level), "n": n, "resamples": resamples}


def pair_row(pair: Pair, truth: float, per_set: list[dict], level: float = 0.95) -> dict:
    """Coverage of the paired interval of ECE(A) − ECE(B), before and after ``difference_at_boundary``."""
    rows = []
    for s in per_set:
        (da, _, wa, pa), (db, _, wb, pb) = s[pair.a], s[pair.b]
        before = difference(da, db, level)
        ca, cb = consistent(pa, level), consistent(pb, level)
        after = difference_at_boundary(before, wa, wb, pa, pb, level)
        rows.append((before, after, ca, cb))
    sets = len(rows)
    share = lambda f: float(np.mean([bool(f(*r)) for r in rows]))  # noqa: E731
    neither = [r for r in rows if not (r[2] or r[3])]
    return {
        "pair": pair.name, "temperature_a": _json_t(pair.a), "temperature_b": _json_t(pair.b), "population_difference": truth,
        "sets": sets,
        "coverage_before": share(lambda b, a, ca, cb: b.low <= truth <= b.high),
        "coverage_after": share(lambda b, a, ca, cb: a.low <= truth <= a.high),
        "a_consistent": share(lambda b, a, ca, cb: ca), "b_consistent": share(lambda b, a, ca, cb: cb),
        "both_consistent": share(lambda b, a, ca, cb: ca and cb),
        "separated_before": share(lambda b, a, ca, cb: b.excludes_zero()),
        "separated_after": share(lambda b, a, ca, cb: a.excludes_zero()),
        "both_consistent_separated_before": share(lambda b, a, ca, cb: ca and cb and b.excludes_zero()),
        "both_consistent_separated_after": share(lambda b, a, ca, cb: ca and cb and a.excludes_zero()),
        "mean_width_before": float(np.mean([b.high - b.low for b, *_ in rows])),
        "mean_width_after": float(np.mean([a.high - a.low for _, a, *_ in rows])),
        "neither_sets": len(neither),
        "neither_width_before": float(np.mean([b.high - b.low for b, *_ in neither])) if neither else None,
        "neither_width_after": float(np.mean([a.high - a.low for _, a, *_ in neither])) if neither else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", type=int, default=200)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--draws", type=Path, default=None,
                    help="an .npz of every set's draws: read where it exists (no scoring), else written")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    temperatures = sorted({c.temperature for c in CASES} | {t for p in PAIRS for t in (p.a, p.b)})
    truths = {t: population_ece(t) for t in temperatures}
    per_set = []
    if args.draws is not None and args.draws.exists():
        per_set, scoring = load_draws(args.draws, temperatures)
        print(f"{len(per_set)} test sets read from {args.draws}", flush=True)
    else:
        for i, one in enumerate(scored(args.sets, args.n, args.resamples, temperatures)):
            per_set.append(one)
            if (i + 1) % 20 == 0:
                print(f"{i + 1} of {args.sets} test sets scored ({time.perf_counter() - t0:.0f} s)", flush=True)
        scoring = time.perf_counter() - t0
        if args.draws is not None:
            save_draws(args.draws, per_set, temperatures, scoring)
    per_set = _intervals(per_set)
    rows = []
    for case in CASES:
        rows.append({**single_row(case, truths[case.temperature], per_set), "n": args.n, "resamples": args.resamples})
        print(rows[-1], flush=True)
    pairs = []
    for pair in PAIRS:
        pairs.append(pair_row(pair, truths[pair.a] - truths[pair.b], per_set))
        print(pairs[-1], flush=True)
    lines = ["| model | population ECE (%) | 95 % interval covers it, before | after | test rejects H₀ |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['case']} | {100 * r['population_ece']:.3f} | {100 * r['coverage_before']:.1f} % | "
              f"{100 * r['coverage_after']:.1f} % | {100 * r['test_rejects']:.1f} % |" for r in rows]
    table = "\n".join(lines)
    pct = lambda v: "—" if v is None else f"{100 * v:.3f}"  # noqa: E731
    lines = ["| pair (A − B) | T_A | T_B | population ECE_A − ECE_B (%) | covers it, before | after | A / B / both "
             "consistent | interval excludes 0, before | after | mean width (%), before | after | where neither is "
             "consistent: sets | width before | after |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['pair']} | {_t(r['temperature_a'])} | {_t(r['temperature_b'])} | {100 * r['population_difference']:+.3f} | "
              f"{100 * r['coverage_before']:.1f} % | {100 * r['coverage_after']:.1f} % | "
              f"{100 * r['a_consistent']:.0f} / {100 * r['b_consistent']:.0f} / {100 * r['both_consistent']:.0f} % | "
              f"{100 * r['separated_before']:.1f} % | {100 * r['separated_after']:.1f} % | "
              f"{100 * r['mean_width_before']:.3f} | {100 * r['mean_width_after']:.3f} | {r['neither_sets']} | "
              f"{pct(r['neither_width_before'])} | {pct(r['neither_width_after'])} |" for r in pairs]
    paired = "\n".join(lines)
    print(table)
    print(paired)
    if args.write:
        OUT.mkdir(exist_ok=True)
        # seconds: scoring the test sets (population values included), also where they were read back.
        (OUT / "boundary.json").write_text(json.dumps({"rows": rows, "pairs": pairs, "seconds": scoring,
                                                       "settings": {**vars(args), "draws": args.draws is not None}},
                                                      indent=2))
        (OUT / "boundary.md").write_text(
            f"# Coverage at the boundary\n\n{args.sets} test sets of {args.n} samples, {args.resamples} resamples, "
            f"K = {K}, logits N(0, {SCALE}²), 15 bins (`python -m bench.boundary --write`).\n\n{table}\n\n"
            f"## Paired differences\n\nTwo methods on the same labels: A reports softmax(z / T_A), B softmax(z / T_B); "
            f"the run's paired 95 % interval of ECE_A − ECE_B before and after `nctv.intervals.difference_at_boundary` "
            f"(A / B consistent: the share of sets whose calibration test cannot reject \"calibrated\").\n\n{paired}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
