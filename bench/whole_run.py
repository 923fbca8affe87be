"""What a whole `nctv run` of Neural Clamping (FL) costs against one of TS by grid search.

    python -m bench.whole_run [--pairs 3] [--threads 2] [--float32] [--write]     # about 2 minutes a pair on 2 idle cores

Each pair runs, as two fresh processes one after the other, the command a user types:

    nctv run --methods ts-grid --seeds 1 --bins 15 --no-cache
    nctv run --methods nc-fl   --seeds 1 --bins 15 --no-cache

on the embedded default (5,000 calibration images, the 10,000 test images), everything a run does
included: starting Python, loading the model and the data, the unperturbed logits (no logit cache),
the fit, the intervals and the calibration test, the tables and the figures. The order alternates
from pair to pair (TS first, then NC first), so that a machine that slows down or speeds up during
the bench weighs on both. The ratio NC / TS of each pair is taken from the wall-clock seconds and
from the CPU seconds (user + system, which a busy machine disturbs less); the report gives every
pair and the median of the ratios, and the passes the fit took. Target: NC at most 1.5 × TS.
``--write`` writes bench/results/whole_run.md and .json, naming the commit and the torch.

``--float32`` adds a third process to every pair, for comparison only: the same NC (FL) run with the
fast fitter's passes in float32 (the model itself, no float64 twin: the fit before it was made the
same on every machine, docs/method.md "Reproducibility"). It tells how much of the gap the float64
arithmetic is, and how much the passes themselves.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.run import _cpu_model, _git, _uptime

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results"
#: The two commands compared, by the CLI's short names, and the target on their ratio.
METHODS = {"ts-grid": "TS by Grid Search", "nc-fl": "Neural Clamping (FL)", "nc-fl-float32": "Neural Clamping (FL)"}
TARGET = 1.5
#: `nctv` with the fast fitter's float64 twin switched off: its passes run the model in float32.
FLOAT32_RUN = ("import sys; import nctv.calibration.clamping as c; c.exact_twin = lambda *a, **k: None; "
               "from nctv.cli import main; sys.exit(main(sys.argv[1:]))")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(short: str, threads: int, folder: Path) -> dict:
    """One whole `nctv run` of ``short``: its wall and CPU seconds, and what the run recorded."""
    out = folder / short
    entry = ["-c", FLOAT32_RUN] if short == "nc-fl-float32" else ["-m", "nctv"]
    cmd = [sys.executable, *entry, "run", "--methods", short.removesuffix("-float32"), "--seeds", "1", "--bins", "15",
           "--no-cache", "--quiet", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    cpu, wall = _children_cpu(), time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=3600)
    wall, cpu = time.perf_counter() - wall, _children_cpu() - cpu
    row = json.loads((out / "results.json").read_text())["methods"][METHODS[short]]
    return {"wall_s": wall, "cpu_s": cpu, "fit_s": row["fit_seconds"][0],
            "passes": row["params"].get("n_passes"), "test_ece": row["metrics"]["15"]["ece"]["mean"]}


def measure(pairs: int, threads: int, log=print, float32: bool = False) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            order = ("ts-grid", "nc-fl") + (("nc-fl-float32",) if float32 else ())
            order = order if i % 2 == 0 else order[::-1]
            got = {short: run_once(short, threads, Path(tmp) / f"pair{i}") for short in order}
            ts, nc = got["ts-grid"], got["nc-fl"]
            rows.append({"order": list(order), "ts": ts, "nc": nc,
                         "wall_ratio": nc["wall_s"] / ts["wall_s"], "cpu_ratio": nc["cpu_s"] / ts["cpu_s"]})
            if float32:
                nc32 = got["nc-fl-float32"]
                rows[-1].update(nc32=nc32, wall_ratio32=nc32["wall_s"] / ts["wall_s"])
            log(f"pair {i + 1}/{pairs}: TS {ts['wall_s']:.1f} s ({ts['cpu_s']:.1f} CPU s), NC {nc['wall_s']:.1f} s "
                f"({nc['cpu_s']:.1f} CPU s, {nc['passes']} passes): {rows[-1]['wall_ratio']:.2f} × wall, "
                f"{rows[-1]['cpu_ratio']:.2f} × CPU")
    out = {"pairs": rows, "median_wall_ratio": statistics.median(r["wall_ratio"] for r in rows),
           "median_cpu_ratio": statistics.median(r["cpu_ratio"] for r in rows)}
    if float32:
        out["median_wall_ratio32"] = statistics.median(r["wall_ratio32"] for r in rows)
    return out


def facts(threads: int) -> dict:
    import torch

    return {"commit": _git("rev-parse", "--short", "HEAD"), "dirty": bool(_git("status", "--porcelain", "--", "nctv")),
            "torch": torch.__version__, "cpu": _cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (spinning threads)"),
            "load_before": _uptime()}


def render(report: dict) -> str:
    f = report["facts"]
    lines = ["# A whole `nctv run`: Neural Clamping (FL) against TS by grid search", "",
             f"commit `{f['commit']}`{' (with uncommitted changes)' if f['dirty'] else ''} · torch {f['torch']} · "
             f"{f['cpu']} ({f['cpu_capability']}) · {f['threads']} threads, OMP_WAIT_POLICY {f['omp_wait_policy']} · made with `python -m bench.whole_run "
             f"--pairs {len(report['pairs'])} --threads {f['threads']}{' --float32' if 'median_wall_ratio32' in report else ''} --write`", "",
             f"Load before: `{f['load_before']}`; after: `{report['load_after']}`.", "",
             "| pair | order | TS wall s (CPU s) | NC wall s (CPU s) | NC fit s | NC passes | NC / TS wall | NC / TS CPU |",
             "| --- | --- | --: | --: | --: | --: | --: | --: |"]
    for i, r in enumerate(report["pairs"], 1):
        ts, nc = r["ts"], r["nc"]
        lines.append(f"| {i} | {' then '.join(r['order'])} | {ts['wall_s']:.1f} ({ts['cpu_s']:.1f}) | "
                     f"{nc['wall_s']:.1f} ({nc['cpu_s']:.1f}) | {nc['fit_s']:.1f} | {nc['passes']} | "
                     f"{r['wall_ratio']:.2f} | {r['cpu_ratio']:.2f} |")
    wall, cpu = report["median_wall_ratio"], report["median_cpu_ratio"]
    verdict = "met" if wall <= TARGET else "missed"
    lines += ["", f"Median NC / TS: **{wall:.2f} × wall-clock**, {cpu:.2f} × CPU time; target at most {TARGET} × "
              f"(wall-clock): **{verdict}**. NC (FL) test ECE {100 * report['pairs'][0]['nc']['test_ece']:.3f} % "
              f"in every pair.", ""]
    if "median_wall_ratio32" in report:
        lines += ["For comparison, the same NC (FL) run with the fit's passes in float32 (not the same on every "
                  "machine; `--float32`):", "",
                  "| pair | float32 NC wall s (CPU s) | fit s | passes | test ECE | float32 NC / TS wall |",
                  "| --- | --: | --: | --: | --: | --: |"]
        for i, r in enumerate(report["pairs"], 1):
            n = r["nc32"]
            lines.append(f"| {i} | {n['wall_s']:.1f} ({n['cpu_s']:.1f}) | {n['fit_s']:.1f} | {n['passes']} | "
                         f"{100 * n['test_ece']:.3f} % | {r['wall_ratio32']:.2f} |")
        lines += ["", f"Median float32 NC / TS: **{report['median_wall_ratio32']:.2f} × wall-clock**.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="write bench/results/whole_run.md and .json")
    ap.add_argument("--float32", action="store_true", help="add the NC run with float32 passes, for comparison")
    args = ap.parse_args(argv)
    report = {"facts": facts(args.threads), **measure(args.pairs, args.threads, float32=args.float32)}
    report["load_after"] = _uptime()
    text = render(report)
    print(text)
    if args.write:
        (OUT / "whole_run.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        (OUT / "whole_run.md").write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
