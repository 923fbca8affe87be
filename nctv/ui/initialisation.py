"""The initialisation tab (the paper's Figure 3): Neural Clamping started from a random δ and from
the data-driven δ̃ of Theorem 1, several runs each, scored on the test split and drawn as box plots."""
from __future__ import annotations

import json
from typing import Any

import gradio as gr

from nctv.ui.calibrate import parse_nc_settings, parse_split
from nctv.ui.common import Worker, export_dir, parse_whole, stream_progress, user_errors, with_warnings
from nctv.ui.state import SplitSpec, get_model, get_splits

METRICS_SHOWN = ("entropy", "ece", "aece", "sce")
MAX_RUNS = 20


def run_study(spec: SplitSpec, runs: int, n_bins: int, settings: dict, report=None):
    """``nctv.experiment.run_init_study`` on the spec's splits; ``report`` gets ("progress", f, msg)."""
    from nctv.experiment import run_init_study

    say = report or (lambda item: None)
    say(("progress", 0.0, f"loading {spec.model} and its splits"))
    loaded = get_model(spec.model)
    cal, test = get_splits(spec)
    return run_init_study(loaded, cal, test, runs=runs, n_bins=n_bins, seed=spec.calibration_seed, progress=False,
                          callback=lambda f, m: say(("progress", f, m)), **settings)


def study_table(result: Any) -> str:
    """Mean ± std per initialisation and metric, in the paper's table units."""
    from nctv.metrics import metric_column

    names = {"random": "random", "data": "data-driven (Theorem 1)"}
    cols = [metric_column(m, result.n_classes) for m in METRICS_SHOWN]
    lines = ["| δ initialisation | " + " | ".join(c.label() for c in cols) + " |", "|:--|" + "--:|" * len(cols)]
    for init in result.study.runs:
        cells = []
        for c in cols:
            s = result.summary(c.key)[init]
            cells.append(f"{s.mean * c.scale:.{c.decimals}f} ± {s.std * c.scale:.{c.decimals}f}")
        lines.append(f"| {names.get(init, init)} | " + " | ".join(cells) + " |")
    s = result.study
    note = (" With the fast fitter the data-driven start is deterministic, so its runs coincide (zero spread)."
            if s.shared_data_fit else "")
    lines.append(f"\n{len(s.seeds)} runs per initialisation (seeds {s.seeds[0]}–{s.seeds[-1]}), test split, "
                 f"{s.n_bins} bins, fitter {s.fitter}, {result.seconds:.1f} s.{note}")
    return "\n".join(lines)


@user_errors(status_of=4)
def init_study(model, hub_id, dataset, calibration_size, test_size, seed, n_bins, runs, gamma, weight_decay, fitter,
               epochs, progress=gr.Progress()):
    """Random vs data-driven δ; streams (status, box plots, table, files)."""
    from nctv import plots

    spec = parse_split(model, hub_id, dataset, calibration_size, test_size, seed)
    n_bins = parse_whole(n_bins, "Number of bins", 2, 100)
    runs = parse_whole(runs, "Runs", 1, MAX_RUNS)
    nc = parse_nc_settings(gamma, weight_decay, "random", fitter, epochs)
    settings = {"gamma": nc.gamma, "weight_decay": nc.weight_decay, "epochs": nc.epochs, "fitter": nc.fitter}
    worker = Worker(lambda report: run_study(spec, runs, n_bins, settings, report))
    result = yield from stream_progress(worker, progress, 4)
    data = plots.init_study_data_from_study(result, metrics_shown=METRICS_SHOWN)
    out = export_dir("init-study")
    (out / "init_study.json").write_text(json.dumps(result.to_dict(), indent=2), encoding="utf-8")
    png = plots.save_figure(plots.init_study_figure(data), out / "init_study.png", dpi=120)
    status = f"**Done**: {runs} runs per initialisation in {result.seconds:.1f} s."
    files = [str(out / "init_study.json"), str(png)]
    yield with_warnings(status, worker), plots.init_study_figure(data, backend="plotly"), study_table(result), files
