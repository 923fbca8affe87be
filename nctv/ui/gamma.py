"""The γ sweep tab (the paper's Figure 2): Neural Clamping fitted for a range of focal-loss γ,
with ECE, entropy and loss on the calibration and the test split, and the chosen γ (lowest
calibration ECE) marked."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import gradio as gr
import numpy as np

from nctv.checks import GAMMA_MAX, read_number
from nctv.report import gamma_table, to_markdown
from nctv.settings import NCOptions
from nctv.ui.calibrate import parse_nc_options, parse_split
from nctv.ui.common import export_dir, parse_whole, stream_progress, user_errors, with_warnings
from nctv.ui.caches import prepare_run
from nctv.ui.gpu import GpuRun, gpu_generator, sweep_work
from nctv.ui.caches import get_model, get_splits
from nctv.ui.session import SplitSpec
from nctv.ui.shipped import shipped_study
from nctv.ui.slides import figure_files, shipped_files, tables_file

#: At most this many γ values per sweep (the paper's grid has 21).
MAX_GAMMAS = 41


def gamma_grid(start: Any, stop: Any, step: Any) -> list[float]:
    """γ = start, start + step, …, up to stop (inclusive), rounded to 4 decimals."""
    a, b, s = (read_number(v) for v in (start, stop, step))
    if a is None or b is None or s is None:
        raise ValueError("γ from, to and step must be numbers, e.g. 0, 1 and 0.1.")
    if not all(np.isfinite([a, b, s])):
        raise ValueError("γ from, to and step must be finite numbers.")
    if a < 0:
        raise ValueError(f"γ must be ≥ 0 (focal loss is undefined below 0); the sweep starts at {a:g}.")
    if b > GAMMA_MAX:
        raise ValueError(f"γ must be at most {GAMMA_MAX:g} (the paper uses 0 to 5); the sweep ends at {b:g}.")
    if b < a:
        raise ValueError(f"The sweep must end at or above its start; got from {a:g} to {b:g}.")
    if s <= 0:
        raise ValueError(f"The γ step must be positive; got {s:g}.")
    count = int(np.floor((b - a) / s + 1e-9)) + 1
    if count > MAX_GAMMAS:
        raise ValueError(f"That is {count} γ values; at most {MAX_GAMMAS} per sweep. Use a larger step.")
    return [round(a + i * s, 4) for i in range(count)]


def run_sweep(spec: SplitSpec, gammas: list[float], n_bins: int, nc: NCOptions, report: Callable[[Any], None]):
    """``nctv.experiment.run_gamma_sweep`` on the spec's splits with Neural Clamping's options ``nc``;
    ``report`` gets ("progress", f, msg)."""
    from nctv.experiment import RunOptions, run_gamma_sweep

    report(("progress", 0.0, f"loading {spec.model} and its splits"))
    loaded = get_model(spec.model)
    cal, test = get_splits(spec)
    options = RunOptions(nc=nc, progress=False, callback=lambda f, m: report(("progress", f, m)), dataset=spec.dataset)
    return run_gamma_sweep(loaded, cal, test, gammas, n_bins, spec.calibration_seed, options=options)


#: The GPU function of the γ sweep (``nctv.ui.gpu``): ``(seconds, spec, gammas, n_bins, nc)`` → items, then the result.
sweep_on_gpu = gpu_generator(run_sweep)


def shipped_view(model: str | None = None) -> tuple[str, Any, str, list[str]] | None:
    """(status, figure, table, files) of the γ sweep shipped beside the pre-computed result, which the
    tab opens on; with none shipped, a status line saying what Run does. With ``model``, the sweep
    beside that menu model's pre-computed result (:func:`nctv.ui.shipped.study_of`), or None."""
    from nctv import plots
    from nctv.calibration.studies import GammaSweep
    from nctv.results import GAMMA_SWEEP_FILE, GammaSweepResult
    from nctv.ui.shipped import study_of

    shipped = shipped_study(GAMMA_SWEEP_FILE) if model is None else study_of(model, GAMMA_SWEEP_FILE)
    if shipped is None and model is not None:
        return None
    if shipped is None:
        return "Press **Run γ sweep** to fit Neural Clamping for every γ of the grid.", None, "", []
    data, path = shipped
    result = GammaSweepResult(GammaSweep.from_dict(data), data["model"], data["calibration"], data["test"],
                              data["settings"], float(data["seconds"]), data["created"])
    fig = plots.gamma_figure(plots.gamma_curve_data_from_sweep(result), backend="plotly")
    status = (f"Showing the sweep *pre-computed, shipped with the app* (model {data['model'].get('name', '?')}, "
              f"γ from {result.sweep.gammas[0]:g} to {result.sweep.gammas[-1]:g}). Press **Run γ sweep** for a live "
              "run with your settings.")
    return status, fig, sweep_table(result), [str(path), *shipped_files(path, lambda to: sweep_slides(result, to))]


def sweep_slides(result: Any, out: Path) -> list[str]:
    """The sweep's figure (PNG, SVG, PDF) and table (a Beamer frame) for slides, in ``out``."""
    from nctv import plots

    return (figure_files(out / "gamma_sweep", plots.gamma_figure, plots.gamma_curve_data_from_sweep(result))
            + [tables_file(out, [gamma_table(result)])])


def sweep_table(result: Any) -> str:
    """The CLI's γ table, plus the cost of the run (the page's answer to "why did it take this long")."""
    s = result.sweep
    return (to_markdown(gamma_table(result))
            + f"\n**Chosen γ = {s.chosen_gamma:g}**; {s.n_passes:.0f} passes over the calibration split in "
              f"{result.seconds:.1f} s.")


@user_errors(status_of=4)
def gamma_sweep(model, hub_id, dataset, calibration_size, test_size, seed, n_bins, gamma_from, gamma_to,
                gamma_step, weight_decay, init, fitter, epochs, lr="default", progress=gr.Progress()):
    """Sweep γ; streams (status, figure, table, files)."""
    from nctv import plots

    spec = parse_split(model, hub_id, dataset, calibration_size, test_size, seed)
    n_bins = parse_whole(n_bins, "Number of bins", 2, 100)
    gammas = gamma_grid(gamma_from, gamma_to, gamma_step)
    nc = parse_nc_options(fitter, weight_decay, epochs, lr, init=init)
    worker = GpuRun(sweep_on_gpu, (spec, gammas, n_bins, nc), prepare=lambda report: prepare_run(
        spec, lambda loaded, n_cal, n_test: sweep_work(nc, gammas, n_cal, n_test), report))
    result = yield from stream_progress(worker, progress, 4)
    fig = plots.gamma_figure(plots.gamma_curve_data_from_sweep(result), backend="plotly")
    out = export_dir("gamma-sweep")
    (out / "gamma_sweep.json").write_text(json.dumps(result.to_dict(), indent=2), encoding="utf-8")
    status = f"**Done**: {len(gammas)} γ values in {result.seconds:.1f} s; chosen γ = {result.sweep.chosen_gamma:g}."
    yield with_warnings(status, worker), fig, sweep_table(result), [str(out / "gamma_sweep.json"),
                                                                    *sweep_slides(result, out)]
