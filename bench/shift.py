"""`python -m bench.shift`: does Neural Clamping's calibration hold under distribution shift?

On each model of the panel (the five over-confident Fashion-MNIST models of `scripts/make_assets.py
panel` and the three mildly over-confident embedded ones; a model not trained on this machine is
listed as not run), the library's shift study (`nctv.shift.run_shift`): uncalibrated,
temperature scaling (NLL), TS by grid search and the default Neural Clamping (FL), fitted once per
seed on the clean 5,000 calibration images, scored on the 10,000 clean test images and on every
default corruption at every severity (ImageNet-C's definitions, CIFAR-10-C's parameters for these
small images). The default Neural Clamping starts at δ₀ = 0 and is the same on every seed, so one
fit per model (`--seeds N` fits N, pooled with the test resamples where a method is random).

Reported per model, per corruption and severity: test ECE of each method with its 95 % interval, and
the paired interval of (NC − TS grid) and (NC − TS) with its verdict (lower / tied / higher); then
counts of the verdicts, and the mean over corruptions per severity. The cost: the default study's
seconds on the embedded default against one clean run of the same methods on the same model, in one
process, as a ratio (the study's target: at most 10 minutes on 2 cores with the app's six methods).

Writes `<out>/report.md`, `<out>/report.json` and `<out>/<model>.json` (each study's figures
and comparisons, without the diagrams' bins). `--render` rewrites report.md from report.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.panel import MILD, OVERCONFIDENT, model_id  # noqa: E402
from nctv.results import COMPARED_METHOD  # noqa: E402
from nctv.shift import ShiftComparison, signed_points  # noqa: E402

MODELS = OVERCONFIDENT + MILD
NC = COMPARED_METHOD
METHODS = ("Uncalibrated", "Temperature Scaling", "TS by Grid Search", NC)
REFERENCES = ("TS by Grid Search", "Temperature Scaling")
STUDY_SECONDS_MAX = 600.0


def _panel_dir() -> Path:
    from nctv.data import cache_dir

    return cache_dir() / "panel"


def _available(name: str, panel_dir: Path) -> bool:
    return not model_id(name, panel_dir).startswith("local-dir:") or (panel_dir / name / "config.json").is_file()


def _compact(result) -> dict:
    """What the report needs of a study: its figures and its Neural Clamping comparisons."""
    d = result.to_dict()
    d.pop("reliability", None)
    d.pop("examples", None)
    d["comparisons"] = [c for c in d["comparisons"] if c["role"] == "reference" and c["metric"] in ("ece", "accuracy")]
    return d


def study(name: str, panel_dir: Path, seeds: int, cal_size: int, test_size: int | None, log) -> dict:
    from nctv.data import get_splits
    from nctv.experiment import RunOptions
    from nctv.shift import run_shift
    from nctv.zoo import load_model

    loaded = load_model(model_id(name, panel_dir))
    cal, test = get_splits(loaded, "fashion-mnist", calibration_size=cal_size, test_size=test_size)
    t0 = time.perf_counter()
    result = run_shift(loaded, cal, test, methods=METHODS, options=RunOptions(
        seeds=seeds, progress=False, precision="fp32",
        callback=lambda f, m: log(f"  {name}: {100 * f:5.1f} % {m}") if m.endswith("fitted") else None))
    log(f"{name}: {time.perf_counter() - t0:.0f} s")
    return _compact(result)


def cost(cal_size: int, log) -> dict:
    """The app's default study (six methods, one seed) against one clean run of the same methods, on the
    embedded default, in this process, both with the logit cache off (every model pass is counted)."""
    from nctv.data import get_splits
    from nctv.experiment import RunOptions, run_experiment
    from nctv.settings import SHIFT_METHODS
    from nctv.shift import run_shift
    from nctv.zoo import DEFAULT_MODEL, load_model

    loaded = load_model(DEFAULT_MODEL)
    cal, test = get_splits(loaded, calibration_size=cal_size)
    options = RunOptions(seeds=1, bins=(15,), progress=False, cache_dir=False, precision="fp32")
    t0 = time.perf_counter()
    run_experiment(loaded, cal, test, SHIFT_METHODS, options)
    clean = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = run_shift(loaded, cal, test, methods=SHIFT_METHODS, options=options)
    shifted = time.perf_counter() - t0
    log(f"cost: clean run {clean:.1f} s, shift study {shifted:.1f} s")
    return {"model": DEFAULT_MODEL, "methods": list(SHIFT_METHODS), "conditions": len(r.conditions),
            "clean_run_s": clean, "shift_study_s": shifted, "ratio": shifted / clean,
            "fit_s": {m: sum(v) for m, v in r.fit_seconds.items()}, "parts_s": dict(r.timing)}


# --------------------------------------------------------------------------- report


def _ci(f: dict) -> str:
    return f"{100 * f['value']:.2f} [{100 * f['ci_low']:.2f}, {100 * f['ci_high']:.2f}]"


def _cmp(d: dict, key: str, other: str) -> dict | None:
    return next((c for c in d["comparisons"] if c["condition"] == key and c["metric"] == "ece" and c["method"] == NC
                 and c["other"] == other), None)


def _verdict(c: dict) -> str:
    return ShiftComparison(**c).verdict


def model_summary(d: dict) -> dict:
    """Verdict counts of NC against each reference over the corrupted conditions, and at each severity's mean."""
    keys = [f"{c}/{s}" for c in d["corruptions"] for s in d["severities"]]
    out = {}
    for other in REFERENCES:
        found = [c for c in (_cmp(d, k, other) for k in keys) if c is not None]
        out[other] = {v: sum(_verdict(c) == v for c in found) for v in ("lower", "tied", "higher")}
        out[other]["clean"] = _verdict(_cmp(d, "clean", other))
        out[other]["mean"] = {s: _cmp(d, f"average/{s}", other) for s in d["severities"]}
    return out


def render(report: dict) -> str:
    from nctv.corruptions import CORRUPTIONS

    lines = ["# NCTV benchmark: calibration under distribution shift", "",
             f"Command: `{report['command']}` · {report['started']} · total {report['minutes']:.1f} min · commit "
             f"`{report['commit']}` · {report['machine']}", "", __doc__.split("\n\n", 1)[1].split("\n\nWrites")[0], ""]
    c = report.get("cost")
    if c:
        lines += ["## Cost", "",
                  f"On {c['model']}, {len(c['methods'])} methods, {c['conditions']} conditions (clean + "
                  f"{c['conditions'] - 1} corrupted), one seed, logit cache off: one clean run {c['clean_run_s']:.1f} s, "
                  f"the shift study {c['shift_study_s']:.1f} s, **{c['ratio']:.1f} ×** the clean run "
                  f"(target ≤ {STUDY_SECONDS_MAX / 60:.0f} min: **{'met' if c['shift_study_s'] <= STUDY_SECONDS_MAX else 'missed'}**). "
                  "Fit seconds: " + ", ".join(f"{m} {s:.1f}" for m, s in c["fit_s"].items()) + "."]
        parts = c.get("parts_s")
        if parts:
            total = sum(parts.values())
            lines += ["", "Where the study's time goes (seconds, share of the parts): " + ", ".join(
                f"{k} {v:.1f} ({100 * v / total:.0f} %)" for k, v in parts.items()) + ". The model's passes are "
                "the unperturbed logits of each corrupted split (cached afterwards) and Neural Clamping's "
                "f(x + δ); scoring is every logit-space map, metric and interval."]
        lines.append("")
    lines += [f"## Verdicts: {NC} against temperature scaling, test ECE", "",
              "Counts over the 40 corrupted conditions (8 corruptions × 5 severities) of where the 95 % paired "
              "interval of (NC − reference) lies; then the mean over corruptions at severity 5.", "",
              "| model | uncal. clean ECE % | vs TS grid: lower / tied / higher | mean, sev. 5 (pt) | vs TS: lower / tied / higher | mean, sev. 5 (pt) |",
              "| :-- | --: | :-: | :-- | :-: | :-- |"]
    for name in report["models"]:
        d = report["studies"].get(name)
        if d is None:
            lines.append(f"| {name} | not run: {report['missing'].get(name, 'model not available')} | | | | |")
            continue
        s = model_summary(d)
        top = max(d["severities"])
        cells = []
        for other in REFERENCES:
            m = s[other]["mean"][top]
            cells += [f"{s[other]['lower']} / {s[other]['tied']} / {s[other]['higher']}",
                      f"{signed_points(m['difference'])} [{signed_points(m['low'])}, {signed_points(m['high'])}] {_verdict(m)}"]
        unc = d["figures"]["Uncalibrated"]["clean"]["ece"]["value"]
        lines.append(f"| {name} | {100 * unc:.2f} | " + " | ".join(cells) + " |")
    lines.append("")
    for name in report["models"]:
        d = report["studies"].get(name)
        if d is None:
            continue
        lines += [f"## {name}", "", f"Test ECE % with 95 % interval (accuracy % uncalibrated; NC seeds: "
                  f"{len(d['seeds'])}); NC − TS grid and NC − TS in points with their paired interval.", "",
                  "| corruption | sev. | accuracy | uncal. | TS | TS grid | NC | NC − TS grid | NC − TS |",
                  "| :-- | --: | --: | --: | --: | --: | --: | :-- | :-- |"]
        keys = [("clean", 0)] + [(c, s) for c in d["corruptions"] for s in d["severities"]] + \
               [("average", s) for s in d["severities"]]
        for corr, sev in keys:
            key = "clean" if sev == 0 else f"{corr}/{sev}"
            table = d["average"] if corr == "average" else d["figures"]
            row = [CORRUPTIONS[corr].title if corr in CORRUPTIONS else ("mean" if corr == "average" else "clean"),
                   str(sev), f"{100 * table['Uncalibrated'][key]['accuracy']['value']:.2f}"]
            row += [_ci(table[m][key]["ece"]) for m in METHODS]
            for other in REFERENCES:
                cm = _cmp(d, key, other)
                row.append(f"{signed_points(cm['difference'])} [{signed_points(cm['low'])}, {signed_points(cm['high'])}] {_verdict(cm)}")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--seeds", type=int, default=1, help="seeds per model (default 1: the default Neural Clamping is deterministic)")
    ap.add_argument("--calibration-size", type=int, default=5000)
    ap.add_argument("--test-size", type=int, default=None)
    ap.add_argument("--panel-dir", type=Path, default=None, help="where the panel models are (default ~/.cache/nctv/panel)")
    ap.add_argument("--no-cost", action="store_true", help="skip the cost measurement")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "shift")
    ap.add_argument("--render", action="store_true", help="rewrite report.md from report.json")
    ap.add_argument("--cost-only", action="store_true", help="measure the cost again into an existing report.json")
    args = ap.parse_args(argv)
    out = args.out
    if args.render or args.cost_only:
        report = json.loads((out / "report.json").read_text())
        if args.cost_only:
            report["cost"] = cost(args.calibration_size, print)
            (out / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
        report["studies"] = {n: json.loads((out / f"{n}.json").read_text()) for n in report["run"]}
        (out / "report.md").write_text(render(report), encoding="utf-8")
        return 0
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)

    panel_dir = args.panel_dir or _panel_dir()
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    report = {"command": "python -m bench.shift " + " ".join(argv if argv is not None else sys.argv[1:]),
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cores, torch "
                         f"{torch.__version__}, {torch.get_num_threads()} threads",
              "models": list(args.models), "seeds": args.seeds, "missing": {}, "run": [], "studies": {}}
    if not args.no_cost:
        report["cost"] = cost(args.calibration_size, log)
    for name in args.models:
        if not _available(name, panel_dir):
            report["missing"][name] = f"not trained here (python scripts/make_assets.py panel {name})"
            log(f"{name}: not available, skipped")
            continue
        d = study(name, panel_dir, args.seeds, args.calibration_size, args.test_size, log)
        (out / f"{name}.json").write_text(json.dumps(d, separators=(",", ":")), encoding="utf-8")
        report["run"].append(name)
        report["studies"][name] = d
    report["minutes"] = (time.perf_counter() - t0) / 60
    studies = report.pop("studies")
    (out / "report.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    report["studies"] = studies
    (out / "report.md").write_text(render(report), encoding="utf-8")
    log(f"wrote {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
