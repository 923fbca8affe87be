"""NCTV benchmarks: one command, one run, figures side by side as ratios.

    python -m bench            # the full run (documented figures), writes bench/results/report.{md,json}
    python -m bench --quick    # a smoke run on small sizes, writes bench/results/quick/

Every case runs in a fresh interpreter (``bench.cases``) one after the other, so that its peak
resident memory is its own and no two cases share the CPU. What is measured, and how, is written
into the report itself (section notes), so the report can be read without this file.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import panel
from bench.cases import BASELINES, ODIR_METHODS
from nctv.settings import DEFAULT_CALIBRATION_SIZE, SWEEP_GAMMAS
from nctv.zoo import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("fmnist-resnet", "fmnist-vit", "fmnist-mixer")

SECTIONS = ("panel", "fidelity", "sweep", "grid", "baselines", "distributed", "gpu", "intervals")
#: The intervals section: every metric's interval for ten sets of 10,000×10 logits at 1,000 resamples.
INTERVALS_CASE = {"n": 10_000, "k": 10, "methods": 10, "resamples": 1000, "seed": 0}
INTERVALS_SECONDS_MAX = 3.0

# Targets of the performance issue.
DEFAULT_NC_SECONDS_MAX = 15.0
DEFAULT_NC_CAL_SIZE = DEFAULT_CALIBRATION_SIZE
SWEEP_FITS_MAX = 5.0
GRID_SPEEDUP_MIN = 100.0
BASELINES_SECONDS_MAX = 30.0
BASELINES_TARGET_SIZE = (5000, 100)
#: Largest |ΔT| between 1 and 2 processes counted as the same T: one step of the fast fitter's T grid.
DISTRIBUTED_T_TOLERANCE = 1e-3

FULL = dict(cal_size=5000, test_size=None, sweep_size=1000, sequential=21, panel_seeds=3, recipe_epochs=100,
            sizes="5000x10,5000x100,25000x1000", grid_step=0.001, t_max=5.0, loop_cap_s=180.0,
            baseline_cap_s=300.0, large_cap_s=60.0, cap_s=1800.0, distributed_epochs=10, gpu_images=25000)
QUICK = dict(cal_size=500, test_size=2000, sweep_size=300, sequential=2, panel_seeds=2, recipe_epochs=3,
             sizes="1000x10,1000x100,2000x300", grid_step=0.001, t_max=5.0, loop_cap_s=10.0,
             baseline_cap_s=60.0, large_cap_s=30.0, cap_s=600.0, distributed_epochs=2, gpu_images=2000)
#: Cases with at least this many logits (n·k) get ``large_cap_s`` instead of ``cap_s``.
LARGE_LOGITS = 10_000_000
#: From this many classes ODIR's default selection screens the (λ, μ) grid
#: (``nctv.calibration.linear``); there the bench also times the exact selection beside it.
SCREEN_MIN_CLASSES = 30


# --------------------------------------------------------------------------------------------
# Running cases
# --------------------------------------------------------------------------------------------


def _peak_rss_of(pid: int) -> float | None:
    """Peak resident set size (VmHWM) of a running process, MiB, from Linux /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


#: Set by ``--omp-passive``: run every case with OpenMP threads that sleep while they wait.
OMP_PASSIVE = False


def case_environment() -> dict[str, str]:
    """The environment of every case: the caller's, with ``OMP_WAIT_POLICY=PASSIVE`` if asked.

    By default OpenMP threads spin while waiting for each other. When other processes share the
    cores, a spinning thread burns the time slice its partner needs, and a 2-thread torch fit ran
    3–8 × slower than with 1 thread on a loaded 2-core machine; ``--omp-passive`` removes that
    artefact there. On an idle machine it costs instead (the ODIR selection ran about 2 × slower
    with sleeping threads), so it is off unless asked for. A value already set is kept.
    """
    env = dict(os.environ)
    if OMP_PASSIVE:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def run_case(name: str, params: dict, cap_s: float, label: str, log) -> dict:
    """Run one case in a fresh interpreter; returns its result, or what went wrong.

    A case still running after ``cap_s`` seconds is stopped; its peak memory up to then is kept.
    A case with ``processes`` > 1 is started by torchrun on this machine, one interpreter per
    process; its result and peak memory are rank 0's.
    """
    with tempfile.TemporaryDirectory(prefix="nctv-bench-") as tmp:
        path = Path(tmp) / "result.json"
        processes = int(params.get("processes", 1))
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] if processes > 1 else []
        cmd = [sys.executable, *launch, "-m", "bench.cases", name, json.dumps(params), str(path)]
        log(f"{label} ...")
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=case_environment(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = proc.communicate(timeout=cap_s)
        except subprocess.TimeoutExpired:
            peak = _peak_rss_of(proc.pid)
            proc.kill()
            proc.communicate()
            wall = time.perf_counter() - t0
            log(f"{label}: stopped at the {cap_s:.0f} s cap")
            return {"capped": True, "cap_s": cap_s, "process_seconds": wall, "peak_rss_mb": peak, **params}
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not path.exists():
            tail = (stderr or "").strip().splitlines()[-8:]
            log(f"{label}: FAILED (exit {proc.returncode})\n    " + "\n    ".join(tail))
            return {"error": f"exit status {proc.returncode}", "stderr_tail": tail, "process_seconds": wall, **params}
        result = json.loads(path.read_text())
    result["process_seconds"] = wall
    measured = f"{result['seconds']:.2f} s measured, " if "seconds" in result else ""
    log(f"{label}: done ({measured}{wall:.1f} s with start-up)")
    return result


def _parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for part in text.split(","):
        try:
            n, k = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--sizes wants N×K pairs such as 5000x100,25000x1000; got {part!r}.") from None
        if n < 10 or k < 2:
            raise SystemExit(f"--sizes: {part!r} needs N >= 10 samples and K >= 2 classes.")
        sizes.append((n, k))
    return sizes


def sequential_gammas(count: int) -> list[float]:
    """``count`` γ values spread evenly over the sweep grid (both ends included)."""
    idx = sorted({int(round(v)) for v in np.linspace(0, len(SWEEP_GAMMAS) - 1, count)})
    return [SWEEP_GAMMAS[i] for i in idx]


def run_all(args: argparse.Namespace, log) -> dict:
    common = {"device": args.device, "threads": args.threads}
    results: dict[str, Any] = {}
    plan: list[tuple[str, dict, float, str]] = [(case, params, args.cap_s, label)
                                                for case, params, label in panel.plan(args, common)]
    model = DEFAULT_MODEL if DEFAULT_MODEL in args.models else args.models[0]
    if "sweep" in args.sections:
        plan.append(("sweep", dict(common, model=model, cal_size=args.sweep_size, seed=0), args.cap_s,
                     f"γ sweep (21 points) {model}"))
        gammas = sequential_gammas(args.sequential)
        plan.append(("sequential", dict(common, model=model, cal_size=args.sweep_size, seed=0, gammas=gammas),
                     args.cap_s, f"{len(gammas)} sequential fits {model}"))
    if "grid" in args.sections:
        plan.append(("grid", dict(common, model=model, cal_size=args.cal_size, grid_step=args.grid_step,
                                          t_max=args.t_max, loop_cap_s=args.loop_cap_s, repeats=3),
                     args.cap_s, f"grid search vs loop {model}"))
    if "baselines" in args.sections:
        for n, k in _parse_sizes(args.sizes):
            cap = args.large_cap_s if n * k >= LARGE_LOGITS else args.baseline_cap_s
            for method in BASELINES:
                plan.append(("baseline", dict(common, n=n, k=k, method=method, seed=0), cap,
                             f"{method} on {n}×{k}"))
                if method in ODIR_METHODS and k >= SCREEN_MIN_CLASSES and n * k < LARGE_LOGITS:
                    # The same fit with the exact (unscreened) selection, right after it.
                    plan.append(("baseline", dict(common, n=n, k=k, method=method, seed=0, screen=False), cap,
                                 f"{method} (exact selection) on {n}×{k}"))
    if "intervals" in args.sections:
        plan.append(("intervals", dict(common, **INTERVALS_CASE), args.cap_s,
                     "intervals: {methods} sets of {n}×{k} logits, {resamples} resamples".format(**INTERVALS_CASE)))
    if "distributed" in args.sections:
        plan += distributed_plan(args, common, model)
    if "gpu" in args.sections and str(args.device).startswith("cuda"):
        plan += gpu_plan(args, common)
    t0 = time.perf_counter()
    for i, (case, params, cap, label) in enumerate(plan, 1):
        if args.budget_min is not None and time.perf_counter() - t0 > 60 * args.budget_min:
            # Out of time: the cases not started are listed in the report, not silently dropped.
            results["not_run"] = [lab for _, _, _, lab in plan[i - 1:]]
            log(f"budget of {args.budget_min:g} min spent: {len(plan) - i + 1} of {len(plan)} cases not run")
            break
        results.setdefault(case, []).append(run_case(case, params, cap, f"[{i}/{len(plan)}] {label}", log))
    return results


def distributed_plan(args: argparse.Namespace, common: dict, model: str) -> list[tuple[str, dict, float, str]]:
    """The same fit on 1 process with all threads, on 2 processes sharing them, and on 1 process with
    one process's share (the speed-up of adding a process), for the fast fitter and the paper recipe."""
    share = max(1, args.threads // 2)
    configs = [(1, args.threads), (2, share)] + ([(1, share)] if share != args.threads else [])
    plan = []
    for fitter, epochs in (("fast", None), ("paper", args.distributed_epochs)):
        for processes, threads in configs:
            params = dict(common, model=model, cal_size=args.cal_size, test_size=args.test_size, fitter=fitter,
                          epochs=epochs, processes=processes, threads=threads)
            plan.append(("distributed", params, args.cap_s,
                         f"NC {fitter} on {processes} process{'es' if processes > 1 else ''} × {threads} threads"))
    return plan


#: GPU memory caps of the GPU section (GB): none, then an A10G/L4's 24 and a T4's 16.
GPU_CAPS = (None, 24, 16)


def gpu_plan(args: argparse.Namespace, common: dict) -> list[tuple[str, dict, float, str]]:
    """Fast Neural Clamping on the three ImageNet architectures at 224² with ``--gpu-images`` images and
    on the paper's CIFAR ResNet-110 workload (5,000 images, 100 classes), each without a cap and under
    16 GB and 24 GB caps; random weights and inputs, so only the cost is measured."""
    plan = []
    for workload in ("resnet101", "vit-s16", "mixer-b16", "cifar-resnet110"):
        images = 5000 if workload == "cifar-resnet110" else args.gpu_images
        for cap in GPU_CAPS:
            params = dict(common, workload=workload, images=images, cap_gb=cap)
            plan.append(("gpu", params, args.cap_s, f"GPU {workload} × {images} images, "
                                                    f"{'no cap' if cap is None else f'{cap} GB cap'}"))
    return plan


def _md_gpu(runs: list[dict] | None, device: str) -> list[str]:
    lines = ["## 6. GPU: large workloads under memory caps", ""]
    if not runs:
        return lines + [
            f"Not run: this report ran on `{device}`; the section runs with `--device cuda`. What was checked "
            "on the CPU instead: the back-off when a piece runs out of memory (tests/test_memory.py fails "
            "pieces on purpose and checks that every pass gives the same numbers), the precision scope "
            "(tests/test_precision.py: Neural Clamping in bf16 equals the same model wrapped in autocast by "
            "hand) and the rule that picks a precision, on measured numbers. docs/gpu.md says how to "
            "calibrate the paper's models on a 16 GB GPU.", ""]
    lines += ["Fast Neural Clamping (seed 0, at most 20 passes) with random weights and inputs: its cost only. "
              "Caps set with `torch.cuda.set_per_process_memory_fraction`; precision as `auto` chose it "
              "(nctv.precision).", "",
              "| workload | images | cap GB | passes | s | s / pass | peak GPU MB | precision | why |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        cap = "—" if r.get("cap_gb") is None else f"{r['cap_gb']}"
        if not _ok(r):
            lines.append(f"| {r['workload']} | {r['images']} | {cap} | {_failure(r)} | | | | | |")
            continue
        p = r["precision"]
        lines.append(f"| {r['workload']} | {r['images']} | {cap} | {r['passes']:g} | {r['seconds']:.1f} | "
                     f"{r['seconds_per_pass']:.2f} | {r.get('cuda_peak_mb', float('nan')):.0f} | {p['precision']} | "
                     f"{p['reason']} |")
    gpu = next((r.get("gpu") for r in runs if _ok(r)), None)
    return lines + ["", f"GPU: {gpu or 'unknown'}.", ""]


# --------------------------------------------------------------------------------------------
# Machine and run facts
# --------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_facts(args: argparse.Namespace) -> dict:
    import torch

    facts = {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": args.threads,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": args.device,
        "niceness": os.nice(0),
        "omp_wait_policy": case_environment().get("OMP_WAIT_POLICY", "unset (spinning threads)"),
    }
    if args.device.startswith("cuda") and torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    return facts


# --------------------------------------------------------------------------------------------
# Derived figures and targets
# --------------------------------------------------------------------------------------------


def _ok(result: dict | None) -> bool:
    return bool(result) and "error" not in result and not result.get("capped")


def sweep_summary(results: dict) -> dict:
    """The sweep against the sequential fits; with fewer than 21 fits, 21 × their mean."""
    sweep, seq = results["sweep"][0], results["sequential"][0]
    if not (_ok(sweep) and _ok(seq)):
        return {"sweep": sweep, "sequential": seq}
    fits = seq["fits"]
    mean_passes = float(np.mean([f["passes"] for f in fits]))
    mean_seconds = float(np.mean([f["seconds"] for f in fits]))
    n = len(SWEEP_GAMMAS)
    complete = len(fits) == n
    seq_passes = sum(f["passes"] for f in fits) if complete else mean_passes * n
    seq_seconds = sum(f["seconds"] for f in fits) if complete else mean_seconds * n
    return {
        "sweep": sweep, "sequential": seq, "sequential_complete": complete,
        "single_fit_mean_passes": mean_passes, "single_fit_mean_seconds": mean_seconds,
        "sequential_21_passes": seq_passes, "sequential_21_seconds": seq_seconds,
        "sweep_in_single_fits_passes": sweep["passes"] / mean_passes,
        "sweep_in_single_fits_seconds": sweep["seconds"] / mean_seconds,
        "speedup_passes": seq_passes / sweep["passes"], "speedup_seconds": seq_seconds / sweep["seconds"],
    }


def distributed_summary(results: list[dict]) -> list[dict]:
    """Per fitter: 2 processes against 1 process with as many threads in all and against 1 process
    with one process's share of them: T, δ and test ECE differences, time ratios, threads of each."""
    rows = []
    for fitter in dict.fromkeys(r["fitter"] for r in results):
        runs = [r for r in results if r["fitter"] == fitter]
        two = next((r for r in runs if r["processes"] == 2), None)
        ones = sorted((r for r in runs if r["processes"] == 1), key=lambda r: -r["threads"])
        one = ones[0] if ones else None
        share = next((r for r in ones[1:] if two is not None and r["threads"] == two["threads"]), None)
        row: dict[str, Any] = {"fitter": fitter}
        if _ok(one) and _ok(two):
            row.update(one_threads=one["threads"], two_threads=two["threads"])
            d1, d2 = np.asarray(one["delta"]), np.asarray(two["delta"])
            row.update(temperature_difference=abs(two["temperature"] - one["temperature"]),
                       fitted_temperature_difference=abs(two["fitted_temperature"] - one["fitted_temperature"]),
                       max_delta_difference=float(np.abs(d2 - d1).max()), max_delta=float(np.abs(d1).max()),
                       ece_difference=abs(two["test_ece"] - one["test_ece"]),
                       time_ratio=one["seconds"] / two["seconds"])
            if _ok(share):
                row.update(share_threads=share["threads"], speedup_over_share=share["seconds"] / two["seconds"])
        rows.append(row)
    return rows


def grid_summary(result: dict | None) -> dict | None:
    if not _ok(result):
        return None
    loop = result["loop"]
    same = None if result["loop_best_t"] is None else abs(result["loop_best_t"] - result["best_t"]) < 1e-12
    return {"speedup": loop["seconds_full"] / result["vectorised_seconds"], "same_temperature": same}


def baseline_table(results: list[dict]) -> dict[tuple[int, int], list[dict]]:
    """The default fit of every baseline, by size (the exact-selection comparisons left out)."""
    table: dict[tuple[int, int], list[dict]] = {}
    for r in results:
        if r.get("screen") is not False:
            table.setdefault((int(r["n"]), int(r["k"])), []).append(r)
    return table


def selection_comparison(results: list[dict]) -> dict[tuple[int, int], list[dict]]:
    """ODIR's default (screened) selection against the exact one, fitted in the same run: seconds,
    their ratio, and the differences of the choice, the final objective and the test NLL."""
    default = {(int(r["n"]), int(r["k"]), r["method"]): r for r in results if r.get("screen") is not False}
    table: dict[tuple[int, int], list[dict]] = {}
    for r in results:
        if r.get("screen") is not False:
            continue
        n, k, method = int(r["n"]), int(r["k"]), r["method"]
        d = default.get((n, k, method))
        row: dict[str, Any] = {"method": method, "default": d, "exact": r}
        if _ok(d) and _ok(r):
            row.update(ratio=r["seconds"] / d["seconds"], same_choice=(d["lambda"], d["mu"]) == (r["lambda"], r["mu"]),
                       objective_difference=abs(d["objective"] - r["objective"]),
                       test_nll_difference=abs(d["test_nll"] - r["test_nll"]))
        table.setdefault((n, k), []).append(row)
    return table


def targets(args: argparse.Namespace, results: dict) -> list[dict]:
    rows: list[dict] = []

    def add(name: str, measured: str, limit: str, met: bool | None, note: str = "", verdict: str | None = None) -> None:
        rows.append({"target": name, "measured": measured, "limit": limit, "met": met, "note": note,
                     "verdict": verdict or _verdict(met)})

    if "panel_nc" in results:
        for m in panel.summarise(results)["panel"]:
            t, pt = m.get("ece_target"), m.get("pass_target")
            if t and t["rule"] == "paired":
                c = t["paired"][t["best_alternative"]]
                add(f"{m['model']}: NC default − best alternative ({t['best_alternative']}), test ECE, "
                    "upper end of the paired 95 % interval", f"{c['difference']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}] pt",
                    f"≤ +{panel.ECE_MARGIN_PT:g} pt", t["met"],
                    c["relation"] + ("; the interval holds the limit, too wide to tell" if t["met"] is None else ""),
                    panel.target_verdict(t))
            elif t:
                add(f"{m['model']}: NC default mean test ECE vs the best alternative ({t['best_alternative']}) + 0.1 pt",
                    f"{t['measured']:.2f} %", f"≤ {t['value']:.2f} %", t["met"],
                    f"earlier rule on means: {panel.NO_LOGITS}")
            if pt:
                add(f"{m['model']}: default NC passes vs the recipe's", f"{pt['ratio']:.3f}", "≤ 0.2", pt["met"])
        runs = [r for r in results["panel_nc"] if r.get("model") == DEFAULT_MODEL and r.get("row") == "NC default"
                and _ok(r) and not r.get("from_report")]
        name = f"NC default on the embedded default ({DEFAULT_MODEL}, {DEFAULT_NC_CAL_SIZE} images), wall"
        if runs and runs[0].get("cal_size", DEFAULT_NC_CAL_SIZE) and args.cal_size == DEFAULT_NC_CAL_SIZE:
            sec = float(np.median([r["seconds"] for r in runs]))
            cpu = [r["cpu_seconds"] for r in runs if "cpu_seconds" in r]  # reports before the engine ran the panel
            add(name, f"{sec:.1f} s (median of {len(runs)})", f"< {DEFAULT_NC_SECONDS_MAX:g} s on {args.threads} threads",
                sec < DEFAULT_NC_SECONDS_MAX, f"CPU time {np.median(cpu):.1f} s" if cpu else "")
        else:
            add(name, "not measured", f"< {DEFAULT_NC_SECONDS_MAX:g} s", None,
                "needs the default model in the panel at 5000 calibration images")
    if "sweep" in results:
        s = sweep_summary(results)
        if "speedup_passes" in s:
            for unit in ("passes", "seconds"):
                v = s[f"sweep_in_single_fits_{unit}"]
                add(f"21-point γ sweep cost in single fast fits ({unit})", f"{v:.2f} fits",
                    f"≤ {SWEEP_FITS_MAX:g} fits", v <= SWEEP_FITS_MAX,
                    f"on {s['sweep']['cal_size']} calibration images")
        else:
            add("21-point γ sweep cost in single fast fits", "not measured", f"≤ {SWEEP_FITS_MAX:g} fits", None)
    if "intervals" in results:
        r = results["intervals"][0]
        sec = r["intervals"]["seconds"] if _ok(r) else None
        add("intervals of 9 metrics × 10 methods, 10,000×10 logits, 1,000 resamples",
            "not measured" if sec is None else f"{sec:.2f} s ({r['ratio']:.1f} × one evaluation)",
            f"≤ {INTERVALS_SECONDS_MAX:g} s on {args.threads} thread(s)", None if sec is None else sec <= INTERVALS_SECONDS_MAX)
    if "grid" in results:
        g = grid_summary(results["grid"][0])
        if g is None:
            add("grid search speed-up over the per-T loop", "not measured", f"≥ {GRID_SPEEDUP_MIN:g} ×", None)
        else:
            extrap = "" if results["grid"][0]["loop"]["complete"] else "loop time extrapolated"
            add("grid search speed-up over the per-T loop", f"{g['speedup']:.0f} ×", f"≥ {GRID_SPEEDUP_MIN:g} ×",
                g["speedup"] >= GRID_SPEEDUP_MIN, extrap)
            add("grid search picks the loop's temperature",
                "not checked (loop incomplete)" if g["same_temperature"] is None else
                ("same T" if g["same_temperature"] else "different T"), "same T", g["same_temperature"])
    for row in distributed_summary(results.get("distributed", [])):
        name = f"2 processes reach 1 process's T (NC {row['fitter']})"
        if "temperature_difference" in row:
            diff = row["temperature_difference"]
            add(name, f"ΔT = {diff:.1e}", f"≤ {DISTRIBUTED_T_TOLERANCE:g}", diff <= DISTRIBUTED_T_TOLERANCE,
                f"time 1 process / 2 processes: {row['time_ratio']:.2f}")
        else:
            add(name, "not measured", f"≤ {DISTRIBUTED_T_TOLERANCE:g}", None)
    if "baseline" in results:
        rows_5k = baseline_table(results["baseline"]).get(BASELINES_TARGET_SIZE)
        name = "all baselines on 5,000×100 incl. ODIR selection, total fit time"
        if rows_5k and all(_ok(r) for r in rows_5k) and len(rows_5k) == len(BASELINES):
            total = sum(r["seconds"] for r in rows_5k)
            add(name, f"{total:.1f} s", f"< {BASELINES_SECONDS_MAX:g} s", total < BASELINES_SECONDS_MAX)
        elif rows_5k:
            bound = sum(r["seconds"] if _ok(r) else r.get("cap_s", r.get("process_seconds", 0.0)) for r in rows_5k)
            short = len(BASELINES) - sum(_ok(r) for r in rows_5k)
            add(name, f"> {bound:.0f} s", f"< {BASELINES_SECONDS_MAX:g} s", False,
                f"{short} of {len(BASELINES)} did not finish (capped or failed); their cap or time counted as a lower bound")
        else:
            add(name, "not measured", f"< {BASELINES_SECONDS_MAX:g} s", None)
    return rows


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _f(v: Any, digits: int = 2, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return f"{v:.{digits}f}{unit}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.2f}"


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "n/a"}[met]


def _failure(r: dict) -> str:
    if r.get("capped"):
        peak = "" if r.get("peak_rss_mb") is None else f" (peak RSS until then {r['peak_rss_mb']:.0f} MB)"
        return f"stopped at the {r['cap_s']:.0f} s cap{peak}"
    return f"failed ({r.get('error')}): {' / '.join(r.get('stderr_tail', [])[-2:])}"


def render_markdown(report: dict) -> str:
    m, run, res = report["machine"], report["run"], report["results"]
    s = report["settings"]
    lines = ["# NCTV benchmark report", ""]
    if run["quick"]:
        lines += ["> **Quick smoke run** on reduced sizes: the figures show that the benchmark works, "
                  "not the documented performance. Run `python -m bench` for the full report.", ""]
    lines += [
        f"Command: `{run['command']}` · started {run['started']} · total {run['total_seconds'] / 60:.1f} min"
        + (f" · commit `{run['commit']}`" + (" (with uncommitted changes)" if run["dirty"] else "") if run["commit"] else "")
        + (f" · figures derived again by `python -m bench --render` at commit `{again['commit']}`"
           + (" (with uncommitted changes)" if again["dirty"] else "") if (again := run.get("rendered_again")) else ""),
        "",
    ]
    if res.get("not_run"):
        lines += [f"> **Stopped at the time budget** (`--budget-min {s.get('budget_min')}`): "
                  f"{len(res['not_run'])} planned cases were not run: " + "; ".join(res["not_run"]) + ".", ""]
    lines += [
        "## Machine",
        "",
        "| | |",
        "| --- | --- |",
        f"| CPU | {m['cpu_model']} |",
        f"| cores | {m['usable_cpus']} usable ({m['logical_cpus']} logical); torch threads: {m['torch_threads']} |",
        f"| device | {m['device']}{' — ' + m['gpu'] if m.get('gpu') else ''} |",
        f"| torch / Python | {m['torch_version']} / {m['python_version']} |",
        f"| process niceness | {m['niceness']} |",
        f"| OMP_WAIT_POLICY of every case | {m['omp_wait_policy']} (see `bench.run.case_environment`) |",
        f"| load average at start (1/5/15 min) | {' / '.join(f'{v:.2f}' for v in run['load_start'])} |",
        f"| load average at end (1/5/15 min) | {' / '.join(f'{v:.2f}' for v in run['load_end'])} |",
        "",
    ]
    threads = m.get("torch_threads") or 1
    lines += [f"While a case runs the bench itself accounts for about {threads} of the load average, so a figure "
              f"well above {threads} at the end means other work shared the CPU; a high figure at start can also be "
              "work that had just finished (the averages decay over 1, 5 and 15 minutes). On a shared machine "
              "absolute seconds are longer than on an idle one; passes and the ratios of figures measured in the "
              "same run are the robust numbers. CPU seconds (this process's user + system time) are given beside "
              "wall seconds.", ""]

    lines += ["## Targets", "", "| target | measured | limit | verdict | note |", "| --- | --- | --- | --- | --- |"]
    for t in report["targets"]:
        lines.append(f"| {t['target']} | {t['measured']} | {t['limit']} | {t.get('verdict') or _verdict(t['met'])} | {t['note']} |")
    lines.append("")

    if "panel_nc" in res or "nctoolkit" in res:
        if not s.get("nctoolkit"):
            lines += ["NCToolkit was not run: give the path of a checkout of the authors' code with "
                      "`--nctoolkit PATH` for its rows and the fidelity section.", ""]
        lines += panel.markdown(panel.summarise(res), s)
    if "sweep" in res:
        lines += _md_sweep(res)
    if "grid" in res:
        lines += _md_grid(res["grid"][0])
    if "baseline" in res:
        lines += _md_baselines(res["baseline"], s)
    if "distributed" in res:
        lines += _md_distributed(res["distributed"], report["derived"]["distributed"])
    if "gpu" in s.get("sections", []):
        lines += _md_gpu(res.get("gpu"), m["device"])
    if "intervals" in res:
        lines += _md_intervals(res["intervals"][0])
    lines += ["## How to read the memory columns", "",
              "Every case ran in its own fresh Python process. *Peak RSS* is that process's "
              "`ru_maxrss` (whole process: interpreter, torch, model and data included); *before* is the "
              "resident size just before the measured call, so peak − before bounds what the call itself "
              "added. `tracemalloc` is not used: torch allocates outside Python's allocator.", ""]
    return "\n".join(lines)


def _md_intervals(r: dict) -> list[str]:
    lines = ["## 7. Intervals of a run's figures", ""]
    if not _ok(r):
        return lines + [f"Not measured: {_failure(r)}.", ""]
    return lines + [
        f"Every metric ({r['metrics']}) of {r['methods']} sets of {r['n']:,}×{r['k']} logits at {r['resamples']:,} "
        "resamples of the test split (one shared count matrix; intervals and paired ECE differences), against "
        "one evaluation of the same metrics of every set.", "",
        "| | wall s | CPU s |", "| --- | --- | --- |",
        f"| one evaluation (all sets) | {_f(r['evaluation']['seconds'], 3)} | {_f(r['evaluation']['cpu_seconds'], 3)} |",
        f"| intervals (all sets) | {_f(r['intervals']['seconds'], 3)} | {_f(r['intervals']['cpu_seconds'], 3)} |",
        f"| ratio | {_f(r['ratio'], 1)} × | |", ""]


def _md_sweep(results: dict) -> list[str]:
    s = sweep_summary(results)
    lines = ["## 2. γ sweep (21 points, 0 to 1 step 0.05) vs sequential fits", ""]
    if "speedup_passes" not in s:
        for key in ("sweep", "sequential"):
            if s.get(key) is not None and not _ok(s[key]):
                lines.append(f"- {key}: {_failure(s[key])}")
        return lines + [""]
    sw, seq = s["sweep"], s["sequential"]
    gammas = ", ".join(f"{f['gamma']:g}" for f in seq["fits"])
    how = ("all 21 sequential fits were run" if s["sequential_complete"] else
           f"{len(seq['fits'])} of the 21 sequential fits were run (γ = {gammas}); the cost of 21 is "
           f"extrapolated as 21 × their mean")
    lines += [
        f"Model {sw['model']}, a subset of {sw['cal_size']} calibration images (seed 0) for both sides. "
        f"Sweep: `gamma_sweep` with the fast fitter (each γ its own fit, as a run at that γ; the first pass "
        f"over the calibration split shared). Sequential: independent fast fits from scratch, one per γ; {how}. "
        "Each process does one untimed warm-up forward + backward on a batch first.",
        "",
        "| | passes | seconds | peak RSS MB |",
        "| --- | --- | --- | --- |",
        f"| sweep, 21 γ | {sw['passes']:g} | {sw['seconds']:.1f} | {sw['peak_rss_mb']:.0f} |",
    ]
    for f in seq["fits"]:
        lines.append(f"| single fit, γ = {f['gamma']:g} | {f['passes']:g} | {f['seconds']:.1f} | |")
    label = "21 sequential fits" + ("" if s["sequential_complete"] else " (extrapolated)")
    lines += [
        f"| mean single fit | {s['single_fit_mean_passes']:.2f} | {s['single_fit_mean_seconds']:.1f} | {seq['peak_rss_mb']:.0f} |",
        f"| {label} | {s['sequential_21_passes']:.1f} | {s['sequential_21_seconds']:.1f} | |",
        "",
        f"Sweep cost = {s['sweep_in_single_fits_passes']:.2f} single fits in passes, "
        f"{s['sweep_in_single_fits_seconds']:.2f} in seconds; sequential / sweep = "
        f"{s['speedup_passes']:.1f} × in passes, {s['speedup_seconds']:.1f} × in seconds. "
        f"Chosen γ (lowest calibration ECE): {sw['chosen_gamma']:g}.",
        "",
    ]
    return lines


def _md_grid(r: dict) -> list[str]:
    lines = ["## 3. TS grid search: branch and bound and full curve vs a per-temperature loop", ""]
    if not _ok(r):
        return lines + [f"- {_failure(r)}", ""]
    g = grid_summary(r)
    loop = r["loop"]
    loop_t = "—" if r["loop_best_t"] is None else f"{r['loop_best_t']:g}"
    how = ("the loop ran over the whole grid" if loop["complete"] else
           f"the loop was stopped after {loop['n_done']} of {r['n_grid']} temperatures (its projected time passed "
           f"the cap) and its full time is extrapolated linearly: {loop['seconds']:.1f} s × {r['n_grid']}/{loop['n_done']}")
    lines += [
        f"Calibration logits of {r['model']} ({r['cal_size']} × K), grid {r['grid_step']:g}, {2 * r['grid_step']:g}, …, "
        f"{r['t_max']:g} ({r['n_grid']} temperatures), ECE with 15 bins. Library search: "
        f"`grid_search_temperature` (default: vectorised branch and bound, which evaluates a coarse subset and "
        f"then only the intervals whose lower bound on the ECE can still beat the best found); full curve: the "
        f"same with `full_curve=True` (every T, vectorised); median of {len(r['vectorised_runs'])} runs each. "
        f"Loop: `nctv.metrics.ece(z / T, y)` for each T; {how}.",
        "",
        "| | seconds | temperatures evaluated | best T | ECE at best T % |",
        "| --- | --- | --- | --- | --- |",
        f"| branch and bound (default) | {r['vectorised_seconds']:.3f} | {r.get('n_evaluated', r['n_grid'])} | "
        f"{r['best_t']:g} | {_pct(r['best_ece'])} |",
        *([f"| full curve | {r['full_curve_seconds']:.3f} | {r['n_grid']} | {r['full_curve_best_t']:g} | |"]
          if "full_curve_seconds" in r else []),
        f"| loop | {loop['seconds_full']:.1f}{'' if loop['complete'] else ' (extrapolated)'} | {r['n_grid']} | {loop_t} | |",
        "",
        f"Speed-up {g['speedup']:.0f} × (full curve: "
        f"{loop['seconds_full'] / r['full_curve_seconds'] if r.get('full_curve_seconds') else float('nan'):.0f} ×); "
        f"largest difference between the full curve and the loop's over the "
        f"temperatures both computed: {r['max_abs_ece_difference']:.2e}; the branch and bound's values equal the "
        f"full curve's where it evaluated: {r.get('bounded_matches_full', '—')}. Peak RSS {r['peak_rss_mb']:.0f} MB.",
        "",
    ]
    return lines


def _md_baselines(results: list[dict], s: dict) -> list[str]:
    lines = [
        "## 4. Baselines on synthetic logits",
        "",
        "Synthetic, overconfident logits (`bench.cases.synthetic_logits`: calibrated logits u with the top "
        "class right about 70 % of the time, labels drawn from softmax(u), returned as 2.5 · u, so T = 2.5 is "
        "ideal for temperature scaling), seed 0 for fitting and seed 1 for a test set of the same size. Seconds = `fit()` only, including ODIR's (λ, μ) "
        "selection by 3-fold cross-validation (the default) over the 7 × 7 grid and the refit. "
        f"Each case was capped at {s['baseline_cap_s']:.0f} s (ten times the target for all seven together, so a "
        f"capped case misses it anyway), and cases with ≥ {LARGE_LOGITS:,} logits at {s['large_cap_s']:.0f} s "
        "(that size is meant for a GPU). A capped process is stopped; nothing of it is reported but the cap.",
        "",
    ]
    for (n, k), rows in baseline_table(results).items():
        lines += [f"### {n:,} × {k:,}", "",
                  "| method | seconds | CPU s | test ECE % (uncal. → cal.) | fitted | peak RSS MB (before) |",
                  "| --- | --- | --- | --- | --- | --- |"]
        total, complete = 0.0, True
        for r in rows:
            if not _ok(r):
                complete = False
                lines.append(f"| {r['method']} | {_failure(r)} | | | | |")
                continue
            total += r["seconds"]
            fitted = ", ".join(f"{key} {r[key]:.4g}" for key in ("temperature", "lambda", "mu") if key in r)
            if "n_iter" in r:
                fitted += (", " if fitted else "") + f"{int(r['n_iter'])} iterations"
            lines.append(f"| {r['method']} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | "
                         f"{_pct(r['uncalibrated_test_ece'])} → {_pct(r['test_ece'])} | {fitted} | "
                         f"{r['peak_rss_mb']:.0f} ({r['rss_before_mb']:.0f}) |")
        lines += [f"| **all {'together' if complete else 'that finished'}** | **{total:.2f}** | | | | |", ""]
        comparison = selection_comparison(results).get((n, k))
        if comparison:
            lines += _md_selection_comparison(comparison)
    return lines


def _md_distributed(runs: list[dict], rows: list[dict]) -> list[str]:
    first = next((r for r in runs if _ok(r)), None)
    recipe = next((r for r in runs if r["fitter"] == "paper"), None)
    lines = ["## 5. Distributed: 1 against 2 processes", ""]
    if first is not None:
        lines += [
            f"The same Neural Clamping fit (seed 0) of {first['model']} on {first['cal_size']} calibration images, "
            f"test ECE on {first['test_size']} test images (15 bins), on 1 process and on 2 processes started by "
            "`torchrun --standalone` on this machine (gloo; docs/distributed.md). Each process holds half of each "
            "split; the objective's sums and gradients are added across processes, logits gathered. Seconds: the "
            "fit (the processes start it together) and, apart, the test split's calibrated logits. The paper "
            f"recipe runs {recipe['epochs'] if recipe else '—'} epochs here, not the published 100.", "",
        ]
    lines += ["| fitter | processes × threads | T | fitted T | test ECE % | passes | fit s | test logits s | "
              "peak RSS MB (rank 0) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        how = f"{r['processes']} × {r['threads']}"
        if not _ok(r):
            lines.append(f"| {r['fitter']} | {how} | {_failure(r)} | | | | | | |")
            continue
        lines.append(f"| {r['fitter']} | {how} | {r['temperature']:.4f} | {r['fitted_temperature']:.6f} | "
                     f"{_pct(r['test_ece'])} | {r['passes']:g} | {r['seconds']:.2f} | {r['predict_seconds']:.2f} | "
                     f"{r['peak_rss_mb']:.0f} |")
    lines.append("")
    for row in rows:
        if "time_ratio" not in row:
            continue
        speed = (f"; 1 process × {row['share_threads']} / 2 processes: {row['speedup_over_share']:.2f}"
                 if "speedup_over_share" in row else "")
        lines.append(
            f"- {row['fitter']}: |ΔT| {row['temperature_difference']:.1e}, |Δ fitted T| "
            f"{row['fitted_temperature_difference']:.1e}, max |Δδ| {row['max_delta_difference']:.1e} (max |δ| "
            f"{row['max_delta']:.3g}), |Δ test ECE| {100 * row['ece_difference']:.1e} points; fit time 1 process × "
            f"{row['one_threads']} / 2 processes × {row['two_threads']}: {row['time_ratio']:.2f}{speed}.")
    return lines + [""]


def _md_selection_comparison(rows: list[dict]) -> list[str]:
    lines = ["ODIR's default selection screens the (λ, μ) grid at this size; the same fit with the exact "
             "selection (`screen=False`: every grid point on every fold to the CV tolerance) ran right after "
             "it, in its own process:", "",
             "| method | default s | exact s | exact / default | same (λ, μ) | Δ objective | Δ test NLL | "
             "points refined |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        d, e = row["default"], row["exact"]
        if "ratio" not in row:
            cells = [f"{r['seconds']:.2f}" if _ok(r) else _failure(r) if r else "not run" for r in (d, e)]
            lines.append(f"| {row['method']} | {cells[0]} | {cells[1]} | | | | | |")
            continue
        refined = f"{d['refined_points']} of {d['grid_points']}" if d.get("screened") else "— (fell back to exact)"
        lines.append(f"| {row['method']} | {d['seconds']:.2f} | {e['seconds']:.2f} | {row['ratio']:.2f} | "
                     f"{'yes' if row['same_choice'] else '**no**'} | {row['objective_difference']:.1e} | "
                     f"{row['test_nll_difference']:.1e} | {refined} |")
    return lines + [""]


def _clean(v: Any) -> Any:
    """JSON-safe copy: NaN/inf become null, tuple keys become "NxK" strings."""
    if isinstance(v, dict):
        return {(f"{k[0]}x{k[1]}" if isinstance(k, tuple) else k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run on small sizes (not the documented figures)")
    ap.add_argument("--models", nargs="+", default=[DEFAULT_MODEL, *MODELS], help="embedded models of the sweep and grid sections")
    ap.add_argument("--panel-dir", type=Path, default=None,
                    help="folder of the over-confident panel (scripts/make_assets.py panel; default ~/.cache/nctv/panel)")
    ap.add_argument("--panel-models", nargs="+", default=[*panel.OVERCONFIDENT, *panel.MILD], help="models of the panel")
    ap.add_argument("--panel-seeds", type=int, help="seeds per stochastic panel row (full 3)")
    ap.add_argument("--panel-rows", nargs="+", choices=[*panel.NC_ROWS, "NCToolkit"],
                    help="Neural Clamping rows of the panel (default: all)")
    ap.add_argument("--nctoolkit-seeds", type=int, help="seeds of the panel's NCToolkit row (default: --panel-seeds)")
    ap.add_argument("--panel-reference", nargs="+", type=Path, default=[],
                    help="report.json files of earlier panel runs: their Neural Clamping and NCToolkit rows that "
                         "this run does not make are added to its panel, marked with the report they came from "
                         "(for the 100-epoch recipes, which take hours on a CPU)")
    ap.add_argument("--budget-min", type=float,
                    help="start no case after this many minutes; the report lists the cases not run")
    ap.add_argument("--recipe-epochs", type=int, help="epochs of the SGD recipes and of NCToolkit (full 100, as published)")
    ap.add_argument("--nctoolkit", type=Path, default=None,
                    help="a checkout of the authors' NCToolkit (the folder holding neural_clamping/); without it, "
                         "its rows and the fidelity section are not run")
    ap.add_argument("--fidelity-models", nargs="+", default=list(panel.OVERCONFIDENT), help="models of the fidelity section")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS, help="parts to run")
    ap.add_argument("--cal-size", type=int, help=f"calibration images for NC and the grid (full {FULL['cal_size']})")
    ap.add_argument("--test-size", type=int, help="test images (full: the whole test split)")
    ap.add_argument("--sweep-size", type=int, help=f"calibration images for the γ sweep part (full {FULL['sweep_size']})")
    ap.add_argument("--sequential", type=int, help=f"sequential fits measured, 2–21 (full {FULL['sequential']})")
    ap.add_argument("--sizes", help=f"synthetic logit sizes N×K (full {FULL['sizes']})")
    ap.add_argument("--loop-cap-s", type=float, help="time cap of the per-T loop before extrapolating")
    ap.add_argument("--baseline-cap-s", type=float, help="time cap per baseline case (full 300)")
    ap.add_argument("--large-cap-s", type=float, help=f"time cap per baseline case with ≥ {LARGE_LOGITS:,} logits (full 60)")
    ap.add_argument("--distributed-epochs", type=int,
                    help=f"epochs of the paper recipe in the distributed section (full {FULL['distributed_epochs']})")
    ap.add_argument("--gpu-images", type=int,
                    help=f"images of the GPU section's ImageNet workloads (full {FULL['gpu_images']:,}, the paper's)")
    ap.add_argument("--cap-s", type=float, help="time cap per Neural Clamping, panel or grid case (full 1800)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in every case")
    ap.add_argument("--omp-passive", action="store_true",
                    help="OMP_WAIT_POLICY=PASSIVE in every case (use on a machine that other work shares)")
    ap.add_argument("--out", type=Path, help="output folder (full: bench/results, quick: bench/results/quick)")
    args = ap.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.grid_step, args.t_max = defaults["grid_step"], defaults["t_max"]
    if args.panel_dir is None:
        from nctv.data import cache_dir

        args.panel_dir = cache_dir() / "panel"
    if args.nctoolkit is not None and not (args.nctoolkit / "neural_clamping" / "nc_wrapper.py").is_file():
        ap.error(f"--nctoolkit {args.nctoolkit}: no neural_clamping/nc_wrapper.py there; give the folder of a checkout.")
    if args.out is None:
        args.out = ROOT / "bench" / "results" / ("quick" if args.quick else "")
    if not 2 <= args.sequential <= len(SWEEP_GAMMAS):
        ap.error(f"--sequential must be between 2 and {len(SWEEP_GAMMAS)}; got {args.sequential}.")
    for key in ("cal_size", "sweep_size", "threads"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be at least 1.")
    return args


def render_again(path: Path) -> int:
    """Derive the panel figures and the targets of a panel run's report.json again with the current
    summaries (after a change to how they are derived, not to what was measured) and rewrite its
    report.md and report.json; the measured results are kept as they are."""
    report = json.loads(path.read_text())
    results = report["results"]
    if set(results) - {"panel_baselines", "panel_nc", "nctoolkit", "panel_references", "not_run"}:
        print(f"{path}: --render takes the report of a panel run (panel and fidelity sections) only", file=sys.stderr)
        return 2
    args = argparse.Namespace(**{**vars(parse_args([])), **report["settings"]})
    if args.panel_reference:  # lend the rows again, by the current rule
        for kind in ("panel_nc", "nctoolkit"):
            results[kind] = [r for r in results.get(kind, []) if not r.get("from_report")]
        results.pop("panel_references", None)
        panel.add_reference_rows(results, [Path(p) for p in args.panel_reference])
    report["targets"] = targets(args, results)
    report.setdefault("derived", {})["panel"] = panel.summarise(results)
    report["run"]["rendered_again"] = {"commit": _git("rev-parse", "--short", "HEAD"),
                                       "dirty": bool(_git("status", "--porcelain"))}
    path.write_text(json.dumps(_clean(report), indent=1, allow_nan=False) + "\n")
    (path.parent / "report.md").write_text(render_markdown(report) + "\n")
    print(f"wrote {path.parent / 'report.md'} and {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    global OMP_PASSIVE
    if argv is None:
        argv = sys.argv[1:]
    if len(argv) == 2 and argv[0] == "--render":
        return render_again(Path(argv[1]))
    args = parse_args(argv)
    # Checked here, not in parse_args: --render derives figures again and needs no model.
    # The zoo's models (the embedded over-confident default among them) need no training.
    missing = [m for m in args.panel_models if panel.model_id(m, args.panel_dir) != m and not (args.panel_dir / m).is_dir()]
    if "panel" in args.sections and missing:
        print(f"python -m bench: error: panel models missing in {args.panel_dir}: {', '.join(missing)}; train them "
              "with `python scripts/make_assets.py panel` (about 50 min on 2 cores) or pass --panel-dir.", file=sys.stderr)
        return 2
    OMP_PASSIVE = bool(args.omp_passive)
    args.out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)

    started = _dt.datetime.now().astimezone()
    load_start, uptime_start = os.getloadavg(), _uptime()
    commit, dirty = _git("rev-parse", "--short", "HEAD"), bool(_git("status", "--porcelain"))
    t0 = time.perf_counter()
    log(f"NCTV benchmarks ({'quick' if args.quick else 'full'}); load average {load_start[0]:.2f}")
    results = run_all(args, log)
    total = time.perf_counter() - t0
    if args.panel_reference:
        panel.add_reference_rows(results, args.panel_reference)
    load_end, uptime_end = os.getloadavg(), _uptime()
    settings = {k: ([str(p) for p in v] if isinstance(v, list) and v and isinstance(v[0], Path)
                    else str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report = {
        "run": {
            "command": " ".join(["python -m bench", *argv]),
            "quick": args.quick, "started": started.isoformat(timespec="seconds"), "total_seconds": total,
            "load_start": list(load_start), "load_end": list(load_end),
            "uptime_start": uptime_start, "uptime_end": uptime_end,
            "commit": commit, "dirty": dirty,
        },
        "machine": machine_facts(args),
        "settings": settings,
        "results": results,
        "targets": targets(args, results),
    }
    if "panel_nc" in results or "nctoolkit" in results:
        report["derived"] = {"panel": panel.summarise(results)}
    if "sweep" in results:
        s = sweep_summary(results)
        report.setdefault("derived", {})["sweep"] = {k: v for k, v in s.items() if k not in ("sweep", "sequential")}
    if "grid" in results:
        report.setdefault("derived", {})["grid"] = grid_summary(results["grid"][0])
    if "baseline" in results:
        report.setdefault("derived", {})["odir_selection"] = {
            size: [{k: v for k, v in row.items() if k not in ("default", "exact")} for row in rows]
            for size, rows in selection_comparison(results["baseline"]).items()}
    if "distributed" in results:
        report.setdefault("derived", {})["distributed"] = distributed_summary(results["distributed"])
        for r in results["distributed"]:
            r.pop("delta", None)  # compared above; 784 numbers per run need not be kept
    (args.out / "report.json").write_text(json.dumps(_clean(report), indent=1, allow_nan=False) + "\n")
    (args.out / "report.md").write_text(render_markdown(report) + "\n")
    log(f"done in {total / 60:.1f} min; wrote {args.out / 'report.md'} and report.json")
    for t in report["targets"]:
        log(f"  {t.get('verdict') or _verdict(t['met']):>10}  {t['target']}: {t['measured']} (limit {t['limit']})")
    return 0
